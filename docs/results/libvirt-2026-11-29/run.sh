#!/bin/bash
# set h: per repeat both paths, interleaved, one repeat per hold of the VM lock
SET=${1:-docs/results/libvirt-2026-11-29}
for n in 1 2 3; do for via in attach libvirt; do
  flock /tmp/livemig-vm.lock livemig bench --via $via bench/scenarios/attach.toml \
      --families busy-db-400mbit --profiles upstream-xbzrle,livemig --repeats $n \
      --resume --out $SET/$via
done; done
