#!/bin/bash
# a patched source migrating to an unpatched destination (a host not yet upgraded),
# against the stock profiles and livemig on stock QEMU at both ends, interleaved
SET=${1:-docs/results/mixed-builds-2026-11-30/after-procmem}
flock /tmp/livemig-vm.lock .venv/bin/python bench/handstarted.py --repeats 3 --out "$SET" \
    --resume --families records,pages --memory 1G --bandwidth 50M \
    --configs upstream,upstream-xbzrle,livemig@mixed,livemig@stock
