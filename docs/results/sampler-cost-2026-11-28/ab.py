import sys, runpy
sys.path.insert(0, "/work/main/src")
import livemig.sampling.peek as peek
peek.PIPELINE = int(sys.argv.pop(1))
sys.argv[0] = "/work/main/bench/sampler_cost.py"
runpy.run_path("/work/main/bench/sampler_cost.py", run_name="__main__")
