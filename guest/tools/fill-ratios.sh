#!/bin/bash
# Compression ratios of the agent's memory fills: dumps a region filled (and then
# dirtied with 4 touches per page) exactly as the mem workload does, for each
# fill kind, and compresses it with zstd -1 (and lz4 -1 / gzip -1 when present).
# usage: guest/tools/fill-ratios.sh [MIB]   (default 64)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mib=${1:-64}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
command -v zstd >/dev/null || { echo "fill-ratios: zstd is missing (apt-get install zstd)" >&2; exit 1; }
make -s -C "$here/../agent" OUT="$work" "$work/dumpfill"
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
codecs=(zstd)
command -v lz4 >/dev/null && codecs+=(lz4)
command -v gzip >/dev/null && codecs+=(gzip)
printf '| fill | %s |\n' "$(printf '%s -1 | ' "${codecs[@]}" | sed 's/ | $//')"
printf '|---|%s\n' "$(printf -- '---|%.0s' "${codecs[@]}")"
for fill in mixed text random zero; do
    "$work/dumpfill" "$fill" "$mib" > "$work/dump"
    size=$(stat -c %s "$work/dump")
    row="| $fill |"
    for c in "${codecs[@]}"; do
        packed=$("$c" -1 -c < "$work/dump" | wc -c)
        row+=" $(ratio "$size" "$packed") |"
    done
    echo "$row"
done
