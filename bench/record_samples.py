"""Record page samples of the benchmark families' guests, for the encoding model's tests.

Boots each family's guest with a plain QEMU command line (anonymous RAM, no RAM file:
the way ``livemig migrate --src-qmp`` meets a user's VM), lets its workload run
``--warmup`` seconds and takes ``--repeats`` samples with the sampler a stock QEMU gets
(``pmemsave`` through the peek sampler: three looks, the middle one counted only). Each
sample is written as ``livemig.sampling.given`` writes it (``FAMILY-N.json`` in
``--out``), so unit tests replay what the model saw on a real guest.

    flock /tmp/livemig-vm.lock python3 bench/record_samples.py --out tests/data/samples \\
        --families records,busy-db-400mbit,hotset-small-400mbit

Families: ``records`` and ``pages`` are ``bench/handstarted.py``'s; the others are
``bench/scenarios/matrix.toml``'s (their workload strings, a 1 GiB guest).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from handstarted import FAMILIES, STOCK, Agent, wait_ready  # noqa: E402

from livemig.bench import load_scenarios  # noqa: E402
from livemig.engine.endpoint import Endpoint  # noqa: E402
from livemig.sampling import given  # noqa: E402
from livemig.sampling.peek import PeekSampler  # noqa: E402
from livemig.sampling.readers import PmemsaveReader, hmp_over  # noqa: E402
from qemuhelp import start_qemu, stop  # noqa: E402


def workloads() -> dict[str, str]:
    out = {k: w for k, (w, _) in FAMILIES.items()}
    for sc in load_scenarios(ROOT / "bench" / "scenarios" / "matrix.toml"):
        if "workload" in sc:
            out[sc["name"]] = sc["workload"]
    return out


async def take(qmp: Path, pid: int, out: Path, family: str, repeats: int,
               gap: float) -> None:
    end = Endpoint("src", qmp, pid=pid)
    await end.connect()
    reader = PmemsaveReader(end.cmd, pid)
    try:
        for n in range(1, repeats + 1):
            sampler = PeekSampler("pmemsave", hmp_over(end.cmd), reader, seed=n, qmp=end.cmd)
            result = await sampler.sample()
            given.dump(out / f"{family}-{n}.json", family, result, time.time())
            s = result.sample
            print(f"{family}-{n}: {s.kept} kept, {s.mid_rewritten} rewritten at "
                  f"{s.mid_interval or 0:.2f}s, {s.rewritten} at {s.interval:.2f}s, "
                  f"{(s.short_rate or 0) / 2**20:.0f} MiB/s short "
                  f"({result.wall_s:.2f}s wall)", flush=True)
            await asyncio.sleep(gap)
    finally:
        reader.close()
        if end.qmp is not None:
            await end.qmp.disconnect()


def main() -> int:
    known = workloads()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--families", default="records,pages",
                    help=f"comma-separated, of: {', '.join(known)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--warmup", type=float, default=6.0)
    ap.add_argument("--qemu", type=Path, default=STOCK)
    a = ap.parse_args()
    fams = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in fams if f not in known]
    if bad:
        print(f"record_samples: unknown family {bad[0]!r}: choose from {', '.join(known)}",
              file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    for fam in fams:
        d = Path(tempfile.mkdtemp(prefix="lm-samples-"))
        agent = Agent(d / "src.agent")
        proc = start_qemu(d, "src", known[fam], memory=a.memory, qemu=a.qemu)
        try:
            agent.start()
            wait_ready(agent, [proc], d / "src.console")
            time.sleep(a.warmup)
            asyncio.run(take(d / "src.qmp", proc.pid, a.out, fam, a.repeats, 1.0))
        finally:
            agent.close()
            stop(proc)
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
