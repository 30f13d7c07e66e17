"""QEMU's short window on a plain QEMU with nothing of livemig's engine beside it:
calc-dirty-rate alone, then the peek sampler (procmem) as the engine runs it but
without the engine's context queries; the guest's own rate from its agent meanwhile.

    python3 window_alone.py 6G "mem:size=1G,rate=80M,hot=70/20,touch=4096,fill=mixed" 2 pc

(run from the repository root's venv, PYTHONPATH=src, under the VM lock)
"""
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from sampler_cost import Rates  # noqa: E402

from livemig.engine.endpoint import Endpoint  # noqa: E402
from livemig.sampling.dirtyrate import ShortRate  # noqa: E402
from livemig.sampling.peek import PeekSampler  # noqa: E402
from livemig.sampling.readers import PmemsaveReader, ProcMemReader, hmp_over  # noqa: E402
from qemuhelp import start_qemu, stop  # noqa: E402

mem, wl, vcpus, mt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
d = Path(tempfile.mkdtemp(prefix="lm-window-"))
p = start_qemu(d, "g", wl, memory=mem, vcpus=vcpus, machine_type=mt,
               qemu=ROOT / "build/qemu-upstream/qemu-system-x86_64")
rates = Rates(d / "g.agent")


async def go() -> None:
    end = Endpoint("g", d / "g.qmp", pid=p.pid)
    await end.connect(10)
    hmp = hmp_over(end.cmd)
    gib = int(mem[:-1]) << 30
    for _ in range(5):
        await asyncio.sleep(3)
        t0 = time.monotonic()
        sr = ShortRate(end.cmd, gib)
        await sr.start()
        await sr.result()
        t1 = time.monotonic()
        print("alone:", sr.note, "guest MiB/s", (rates.rate(t0 - 0.3, t1 + 0.3) or 0) / 2**20)
        await asyncio.sleep(2)
        reader = PmemsaveReader(end.cmd, p.pid, d)
        m = ProcMemReader(hmp, p.pid, reader)
        s = PeekSampler("procmem", hmp, m, qmp=end.cmd, prepare=m.prepare)
        t0 = time.monotonic()
        res = await s.sample()
        t1 = time.monotonic()
        print("in sampler:", res.detail.get("short_rate"), "guest MiB/s in sample",
              (rates.rate(t0, t1) or 0) / 2**20, "wall", round(t1 - t0, 2))
        m.close()
        reader.close()


try:
    t0 = time.time()
    time.sleep(8)
    rates.start()
    while rates.rate(time.monotonic() - 2, time.monotonic()) in (None, 0.0) \
            and time.time() - t0 < 240:
        time.sleep(1)
    time.sleep(3)
    asyncio.run(go())
finally:
    rates.stop = True
    stop(p)
