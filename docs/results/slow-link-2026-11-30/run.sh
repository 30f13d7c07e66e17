#!/bin/bash
# The slow-link busy database through attach and through libvirt, interleaved per
# repeat (as libvirt-2026-11-29/run.sh). Run from the repository's root.
set -euo pipefail
out=docs/results/slow-link-2026-11-30
for n in 1 2 3; do for via in attach libvirt; do
  livemig bench --via $via bench/scenarios/slow-link.toml --repeats $n --resume --out $out/$via
done; done
