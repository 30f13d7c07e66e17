#!/bin/bash
cd /tmp/me/wt3
for i in 1 2 3; do for n in 0 19; do
  LM_NICE=$n flock /tmp/livemig-vm.lock env PYTHONPATH=src .venv/bin/python bench/sampler_cost.py --memory 4G --repeats 8 --samplers pmemsave --out /tmp/me/nice/nice$n-$i.json >> /tmp/me/nice/log 2>&1
  echo "i=$i nice=$n rc=$? $(date +%T)" >> /tmp/me/nice/progress
done; done
