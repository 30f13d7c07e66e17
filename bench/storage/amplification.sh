#!/usr/bin/env bash
# Disk dirty amplification of cross-storage migration (--storage copy) for guest
# write sizes 4K/8K/64K and mirror bitmap granularities 64K/1M, on the testbed's
# 1gbit link. Each cell: one run; the table gives bytes the mirror sent after its
# first full pass divided by the bytes the guest wrote meanwhile.
# usage: bench/storage/amplification.sh [OUTDIR] [REPEATS]
set -euo pipefail
out=${1:-reports/storage-amplification}
repeats=${2:-1}
livemig=${LIVEMIG:-livemig}
mkdir -p "$out"
for gran in 64K 1M; do
    for bs in 4K 8K 64K; do
        for r in $(seq "$repeats"); do
            name="bs$bs-gran$gran-r$r"
            echo "== $name" >&2
            "$livemig" migrate -q --memory 512M --link 1gbit --storage copy \
                --workload "mem:size=128M,rate=32M,hot=80/10+disk:bs=$bs,rate=2M" \
                --bandwidth 24M --set "disk-granularity=$gran" --max-time 150 \
                --report "$out/$name.json" > "$out/$name.txt" 2>&1 || true
        done
    done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    bs, gran = f.stem.split("-")[0][2:], f.stem.split("-")[1][4:]
    rows.setdefault((gran, bs), []).append(r)
print("| granularity | guest write | runs ok | disk sent MiB | after 1st pass MiB "
      "| guest wrote MiB | amplification | network pause ms | disk check |")
print("|---|---|---|---|---|---|---|---|---|")
for (gran, bs), rs in sorted(rows.items(), key=lambda kv: (kv[0][0] != "64K", kv[0][1])):
    ok = [r for r in rs if r["outcome"] == "completed"]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    d = [r["disk_detail"] for r in ok]
    print(f"| {gran} | {bs} | {len(ok)}/{len(rs)} "
          f"| {med([r['disk_transferred_bytes'] / 2**20 for r in ok]):.1f} "
          f"| {med([x['bytes_after_first_pass'] / 2**20 for x in d]):.1f} "
          f"| {med([x['guest_bytes_written_after_first_pass'] / 2**20 for x in d]):.1f} "
          f"| {med([r['disk_dirty_amplification'] for r in ok]):.2f} "
          f"| {med([r['network_pause_ms'] for r in ok]):.0f} "
          f"| {', '.join(sorted({r['consistency']['disk'] for r in rs}))} |")
PY
