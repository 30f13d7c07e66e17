"""bench/sampler_cost.py with the peek sampler's reads in flight set; run from the
checkout: python3 docs/results/sampler-cost-2026-11-28/ab.py N --memory 4G ..."""
import runpy
import sys

sys.path.insert(0, "src")
import livemig.sampling.peek as peek

peek.PIPELINE = int(sys.argv.pop(1))
sys.argv[0] = "bench/sampler_cost.py"
runpy.run_path(sys.argv[0], run_name="__main__")
