import json, sys, collections
run = json.load(open('runs/records-livemig-nice0-1.json'))
rep = json.load(open('runs/records-livemig-nice0-1.report.json'))
t0 = run['trace']['t_launch']
ev = {e['event']: e['t'] for e in rep['events']}
rows = [json.loads(l) for l in open('threadcpu.jsonl')]
hz = 100
# window: launch-1 .. launch+7
rows = [r for r in rows if t0 - 1.5 <= r[0] <= t0 + 7]
first = rows[0][1]
prev = rows[0]
print('events', {k: v for k, v in ev.items() if k in ('phase migrating','encoding chosen','action SetCompression','phase switched')})
print('report t0 vs launch', rep.get('t0', None))
keys = sorted(set().union(*[r[1].keys() for r in rows]))
# classify
cls = {}
tot = {k: max(r[1].get(k,0) for r in rows) - min(r[1][k] for r in rows if k in r[1]) for k in keys}
for k in keys:
    role, pid, tid = k.split(':')
    new = k not in first
    cls[k] = f"{role}{'+' if new else ''}:{tid}"
top = [k for k in sorted(keys, key=lambda k: -tot.get(k, 0)) if tot.get(k, 0) > 2]
print('t     ' + ' '.join(f'{cls[k]:>12}' for k in top))
for a, b in zip(rows[::3], rows[3::3]):
    dt = b[0] - a[0]
    print(f'{a[0]-t0:5.1f} ' + ' '.join(f'{(b[1].get(k,0)-a[1].get(k,b[1].get(k,0)))/hz/dt:12.2f}' for k in top))
