#!/bin/bash
# livemig@stock through libvirt (procmem sampler) against the stock profiles, one
# repeat per hold of the VM lock: 3 interleaved repeats
SET=${1:-docs/results/libvirt-stock-2026-11-29}
for n in 1 2 3; do
  flock /tmp/livemig-vm.lock livemig bench --via libvirt bench/scenarios/attach.toml \
      --families busy-db-400mbit,pages-compressible-1gbit \
      --profiles upstream,upstream-xbzrle,livemig@stock --repeats $n --resume --out $SET -q
done
