"""Medians of livemig and stock, through attach and libvirt, per set and pooled.

From the repository's root: .venv/bin/python docs/results/libvirt-2026-11-29/pool.py
docs/results/libvirt-2026-11-28g docs/results/libvirt-2026-11-29
"""
import glob
import json
import statistics as st
import sys

sys.path.insert(0, "src")
from livemig.bench import METRICS
get = dict(METRICS)
sets = sys.argv[1:]
cols = ['total_time_s', 'qemu_time_s', 'ram_sent_mib', 'work_lost_s', 'downtime_ms', 'first_pass_s']
for prof in ('livemig', 'upstream-xbzrle'):
    med = {}
    for via in ('attach', 'libvirt'):
        for label, sets_ in [(s, [s]) for s in sets] + [('pooled', sets)]:
            rows = []
            for s in sets_:
                for f in sorted(glob.glob(f'{s}/{via}/busy-db-400mbit-{prof}-[0-9].json')):
                    r = json.load(open(f))
                    if r.get('outcome') != 'completed':
                        continue
                    v = {c: get[c](r) for c in cols}
                    if via == 'attach':
                        v['qemu_time_s'] = v['total_time_s']
                    rows.append(v)
            m = {c: round(st.median([x[c] for x in rows if x[c] is not None]), 2) for c in cols}
            med[(via, label)] = m
            print(prof, via, label, len(rows), m, [x['qemu_time_s'] for x in rows])
    for label in [*sets, 'pooled']:
        a, l = med[('attach', label)], med[('libvirt', label)]
        print('  ratio libvirt/attach', label, {c: round(l[c] / a[c], 2) for c in ('qemu_time_s', 'ram_sent_mib', 'work_lost_s', 'first_pass_s') if a[c]})
