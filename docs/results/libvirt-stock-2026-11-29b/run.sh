#!/bin/bash
# the pages family of ../libvirt-stock-2026-11-29 with the profiles' order reversed
# in each repeat (livemig@stock first): is its slower first pass the profile's, or
# the place it ran in?
SET=${1:-docs/results/libvirt-stock-2026-11-29b}
for n in 1 2 3; do
  flock /tmp/livemig-vm.lock livemig bench --via libvirt bench/scenarios/attach.toml \
      --families pages-compressible-1gbit \
      --profiles livemig@stock,upstream --repeats $n --resume --out $SET -q
done
