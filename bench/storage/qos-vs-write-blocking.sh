#!/usr/bin/env bash
# A guest that re-dirties its disk faster than the link copies it (4K writes at
# 4 MB/s, 1M bitmap granularity: every write dirties a megabyte), three ways:
#   none            background mirror, no help (expected: never converges)
#   io-qos          background mirror + livemig's IO QoS (caps guest writes step by step)
#   write-blocking  QEMU's active mirror: every guest write is mirrored synchronously
# usage: bench/storage/qos-vs-write-blocking.sh [OUTDIR] [REPEATS]
set -euo pipefail
out=${1:-reports/qos-vs-write-blocking}
repeats=${2:-3}
livemig=${LIVEMIG:-livemig}
mkdir -p "$out"
declare -A sets=(
    [none]="--set io-qos=off --set disk-copy-mode=background"
    [io-qos]="--set io-qos=on --set disk-copy-mode=background"
    [write-blocking]="--set io-qos=off --set disk-copy-mode=write-blocking"
)
for r in $(seq "$repeats"); do
    for mode in none io-qos write-blocking; do
        echo "== $mode r$r" >&2
        # shellcheck disable=SC2086
        "$livemig" migrate -q --memory 512M --link 1gbit --storage copy --disk-size 256M \
            --workload "mem:size=128M,rate=16M,hot=80/10+disk:bs=4K,rate=4M" \
            --set disk-granularity=1M ${sets[$mode]} --max-time 120 \
            --report "$out/$mode-r$r.json" > "$out/$mode-r$r.txt" 2>&1 || true
    done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.json")):
    rows.setdefault(f.stem.rsplit("-r", 1)[0], []).append(json.loads(f.read_text()))
med = lambda xs: statistics.median(xs) if xs else float("nan")
print("| mode | completed | total s | disk sent MiB | guest pause ms | workload min MiB/s "
      "| s below 10% | disk check |")
print("|---|---|---|---|---|---|---|---|")
for mode in ("none", "io-qos", "write-blocking"):
    rs = rows.get(mode, [])
    ok = [r for r in rs if r["outcome"] == "completed"]
    print(f"| {mode} | {len(ok)}/{len(rs)} "
          f"| {med([r['total_time_s'] for r in ok]):.1f} "
          f"| {med([r['disk_transferred_bytes'] / 2**20 for r in ok]):.0f} "
          f"| {med([r['guest_pause_ms'] for r in ok]):.0f} "
          f"| {med([(r['workload'].get('min_rate') or 0) / 2**20 for r in rs]):.1f} "
          f"| {med([r['workload'].get('seconds_below_10pct') or 0 for r in rs]):.1f} "
          f"| {', '.join(sorted({r['consistency']['disk'] for r in rs}))} |")
PY
