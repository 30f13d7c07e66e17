#!/bin/bash
# usage: DIR=/some/dir start.sh QEMU NAME [extra args]; then
#   livemig migrate --src-qmp $DIR/src.qmp --dst-start --uri tcp:127.0.0.1:PORT \
#       --profile livemig --bandwidth 100M --report R.json
Q=$1; N=$2; shift 2
exec $Q -L /usr/share/seabios -L /usr/share/qemu -nodefaults -no-user-config -display none -accel tcg \
 -machine pc -m 5G,slots=2,maxmem=8G -smp 2 \
 -object memory-backend-ram,id=m0,size=3G -object memory-backend-ram,id=m1,size=2G \
 -numa node,nodeid=0,memdev=m0,cpus=0 -numa node,nodeid=1,memdev=m1,cpus=1 \
 -kernel /work/main/build/guest/vmlinuz -initrd /work/main/build/guest/initrd.img \
 -append "console=ttyS0 quiet livemig.workload=mem:size=512M,rate=0,hot=80/10,touch=128" \
 -serial file:$DIR/$N.console -qmp unix:$DIR/$N.qmp,server=on,wait=off \
 -netdev user,id=n0 -device virtio-net-pci,netdev=n0,romfile= "$@"
