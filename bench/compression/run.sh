#!/bin/bash
# Compression benchmark (not a test): zlib-1, zstd-1 and lz4 at several
# accelerations on three corpora, one core, MB/s and ratio, as a Markdown table.
#   guest   a snapshot of a busy livemig guest's RAM (kernel, page cache and the
#           mem workload's fill=mixed pages), copied from its memory-backend file
#           while `livemig migrate` runs
#   text    the agent's fill=text memory; random: fill=random memory
# usage: bench/compression/run.sh [MIB]   (default 256)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mib=${1:-256}
work=$(mktemp -d)
trap 'rm -rf "$work"; [[ -n ${lm:-} ]] && kill "$lm" 2>/dev/null || true' EXIT
gcc -O2 -o "$work/compbench" "$here/compbench.c" -lz -lzstd -llz4
make -s -C "$root/guest/agent" OUT="$work" "$work/dumpfill"
"$work/dumpfill" text "$mib" > "$work/text"
"$work/dumpfill" random "$mib" > "$work/random"

echo "== booting a busy guest to snapshot its RAM" >&2
livemig migrate --accel tcg --memory 1G --workload "mem:size=512M,rate=64M,hot=80/10" \
    --bandwidth 1M --max-time 60 --run-id compbench --quiet >/dev/null 2>&1 &
lm=$!
ram=/dev/shm/livemig-compbench-src.ram
# the workload has filled its region once the destination exists (after warm-up)
for _ in $(seq 180); do
    [[ -f $ram && -f /run/livemig/compbench/dst.log ]] && break
    sleep 1
done
[[ -f $ram ]] || { echo "no guest RAM file appeared" >&2; exit 1; }
sleep 5
dd if="$ram" of="$work/guest" bs=1M count="$mib" skip=256 status=none
kill "$lm" 2>/dev/null || true; wait "$lm" 2>/dev/null || true; lm=""

echo "| corpus | codec | unit | compress MB/s | decompress MB/s | ratio |"
echo "|---|---|---|---|---|---|"
for c in guest text random; do
    "$work/compbench" "$work/$c" "$c"
done
