#!/bin/bash
# usage: start.sh NAME QEMU [incoming]
name=$1; q=$2; inc=$3
truncate -s 2G /tmp/me/nu/disk.raw 2>/dev/null
args=(-L /usr/share/seabios -L /usr/share/qemu -nodefaults -display none -accel tcg
  -M pc -m 6G -smp 2 -cpu max
  -kernel /work/main/build/guest/vmlinuz -initrd /work/main/build/guest/initrd.img
  -append "console=ttyS0 quiet livemig.workload=mem:size=2G,rate=100M,hot=80/10,fill=mixed"
  -serial file:/tmp/me/nu/$name.console
  -drive file=/tmp/me/nu/disk.raw,format=raw,if=none,id=d0,cache=none,aio=threads -device virtio-blk-pci,drive=d0
  -device virtio-net-pci,netdev=n0,romfile= -netdev user,id=n0
  -qmp unix:/tmp/me/nu/$name.qmp,server=on,wait=off)
[ -n "$inc" ] && args+=(-incoming defer -S)
setsid $q "${args[@]}" > /tmp/me/nu/$name.log 2>&1 < /dev/null &
echo $! > /tmp/me/nu/$name.pid
