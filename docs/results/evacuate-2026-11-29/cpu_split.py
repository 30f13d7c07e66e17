"""CPU-seconds per process kind within each run's drain (evacuation.json's
started_at + wall_s), from cpu_poll.py's lines. A process that ended between two
polls loses at most 0.25 s of its CPU. Usage: python3 cpu_split.py POLL.jsonl SETDIR"""
import collections
import glob
import json
import sys

snaps = [json.loads(line) for line in open(sys.argv[1])]
out = {}
for d in sorted(glob.glob(sys.argv[2] + "/*-[0-9]")):
    ev = json.load(open(d + "/evacuation.json"))
    a = ev["started_at"]
    b = a + ev["wall_s"]
    base, last = {}, {}
    for s in snaps:
        for pid, (_, cpu) in s["p"].items():
            if s["t"] < a:
                base[pid] = cpu
        if a <= s["t"] <= b:
            last.update(s["p"])
    tot = collections.Counter()
    for pid, (k, cpu) in last.items():
        tot[k] += cpu - base.get(pid, 0.0)
    name = d.rstrip("/").split("/")[-1]
    out[name] = {"window_s": round(b - a, 2), "capacity_cpu_s": round(2 * (b - a), 1),
                 **{k: round(v, 1) for k, v in tot.most_common()}}
    print(name, out[name])
json.dump(out, open(sys.argv[2] + "/cpu.json", "w"), indent=1)
