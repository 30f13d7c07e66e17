#!/bin/bash
# to-fixed under CPU stress: the old build, then the new one
for i in 1 2 3; do (while true; do :; done) & done
sleep 1
echo "== old build"; OUT=/tmp/me/qloop-old BIN=./tests/qtest/migration-test.old QBIN=./old/qemu-system-x86_64 /tmp/me/qloop.sh 5
echo "== new build"; OUT=/tmp/me/qloop-new /tmp/me/qloop.sh 5
kill $(jobs -p)
