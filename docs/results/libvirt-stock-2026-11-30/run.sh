#!/bin/bash
# the pages family through libvirt after the shorter stock sample (livemig@stock first,
# as in -29b): the wait before migrate, now
# with QEMU's window inside the half-way wait
SET=${1:-docs/results/libvirt-stock-2026-11-30}
for n in 1 2 3; do
  flock /tmp/livemig-vm.lock livemig bench --via libvirt bench/scenarios/attach.toml \
      --families pages-compressible-1gbit \
      --profiles livemig@stock,upstream --repeats $n --resume --out $SET -q
done
