#!/bin/bash
# run to-fixed N times; dump stacks of a QEMU that lives too long
bdir=/root/.cache/livemig/qemu/10.2.2/patched/build
bin=${BIN:-./tests/qtest/migration-test}
n=${1:-10}
out=${OUT:-/tmp/me/qloop}; mkdir -p $out
( while true; do
    for p in $(pgrep -f 'qemu-system-x86_64 -qtest'); do
      et=$(ps -o etimes= -p $p 2>/dev/null | tr -d ' ')
      if [[ -n $et && $et -gt 75 && ! -e $out/dumped.$p ]]; then
        touch $out/dumped.$p
        { echo "== pid $p age $et"; tr '\0' ' ' < /proc/$p/cmdline | cut -c1-300; echo; gdb -batch -p $p -ex "thread apply all bt" 2>&1 | grep -v "^\[New LWP\|^$" | head -150; } > $out/stack.$p.txt
      fi
    done; sleep 2; done ) &
w=$!
fails=0
for i in $(seq 1 $n); do
  (cd $bdir && unshare -m sh -c 'mount --bind /dev/null /dev/kvm 2>/dev/null; exec "$@"' sh env QTEST_QEMU_BINARY=${QBIN:-./qemu-system-x86_64} PYTHON=/usr/bin/python3 $bin --tap -k -p ${TPATH:-/x86_64/migration/multifd/tcp/plain/compression-switch/to-fixed}) > $out/run.$i.log 2>&1
  rc=$?
  [[ $rc != 0 ]] && fails=$((fails+1))
  echo "run $i rc=$rc $(grep -E '^(ok|not ok)' $out/run.$i.log | tr '\n' ' ') $(grep -m1 'kill_qemu\|ERROR\|assert' $out/run.$i.log)"
done
kill $w
echo "fails=$fails of $n"
