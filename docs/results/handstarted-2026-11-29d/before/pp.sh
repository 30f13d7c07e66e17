#!/bin/bash
# ping-pong the running guest through profiles: pp.sh QEMU CUR profile...
q=$1; cur=$2; shift 2; i=0
for p in "$@"; do
  i=$((i+1)); n=h$RANDOM
  ./start.sh $n $q inc; sleep 8
  port=$((5000+RANDOM%1000))
  start=$(date +%s.%N)
  flock /tmp/livemig-vm.lock /work/main/.venv/bin/livemig migrate --src-qmp $cur.qmp --dst-qmp $n.qmp --uri tcp:127.0.0.1:$port --profile $p --report r-$p-$i.json -q > log-$p-$i.txt 2>&1
  rc=$?; end=$(date +%s.%N)
  python3 - r-$p-$i.json $p $rc $start $end <<'PY'
import json,sys
f,p,rc,s,e=sys.argv[1:]
try: r=json.load(open(f))
except Exception as x: print(p,rc,'no report',x); sys.exit()
enc=r.get('encoding') or {}
print(f"{p:18} rc={rc} cmd={float(e)-float(s):.1f}s qemu={r.get('total_time_s')} MiB={(r.get('ram_transferred_bytes') or 0)/2**20:.0f} enc={enc.get('encoding')} down={r.get('downtime_ms')}")
PY
  kill $(cat $cur.pid) 2>/dev/null; cur=$n; sleep 6
done
echo CUR=$cur
