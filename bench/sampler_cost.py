"""What a page sample costs the guest: wall time of each sampler and the guest's
throughput while it samples, against the same guest's throughput between samples.

A plain QEMU (no lab code: anonymous RAM, the agent's port on a socket) runs a
flat-out memory writer; the agent reports the bytes it wrote about every 100 ms. Each
sampler takes N samples with quiet gaps between them; the guest's write rate inside
the sample windows is compared with its rate in the gaps (interleaved, so host noise
hits both alike).

Two clocks for the guest's rate, both reported: when this process received each rate
line (``in_sample``/``between``; what the runs before 2026-11-29b used), and the
guest's own timestamp in the line (``in_sample_guest``/``between_guest``), mapped to
host time by the smallest receive delay seen. A sampler that keeps this process busy
(the peek samplers run here, the receiving thread waits for the GIL) delays the
receipts, which by the first clock reads as guest work lost; the guest's clock does
not move with this process.

    python3 bench/sampler_cost.py --memory 4G --repeats 5 --out docs/results/sampler-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from livemig.engine.endpoint import Endpoint  # noqa: E402
from livemig.policy import encoding  # noqa: E402
from livemig.sampling.peek import PeekSampler  # noqa: E402
from livemig.sampling.qemu import QemuSampler  # noqa: E402
from livemig.sampling.readers import PmemsaveReader, ProcMemReader, hmp_over  # noqa: E402
from qemuhelp import start_qemu, stop  # noqa: E402

WORKLOAD = "mem:size=256M,rate=0,hot=80/10,touch=128"
# an ablation: procmem with the codecs timed on every kept page and the zlib median
# over every rewritten one, as before encoding.CODEC_PAGES / ZLIB_PAGES
WIDE = "procmem-wide"


class Rates(threading.Thread):
    """(host time, bytes written) from the guest agent's rate lines."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.points: list[tuple[float, int]] = []
        self.guest: list[tuple[float, int]] = []  # (guest's own seconds, bytes)
        self.stop = False

    def run(self) -> None:
        import socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self.path))
            s.settimeout(0.2)
            buf = b""
            while not self.stop:
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                now = time.monotonic()
                for line in lines:
                    try:
                        d = json.loads(line)
                    except ValueError:
                        continue
                    if d.get("ev") == "rate":
                        self.points.append((now, int(d["mem_bytes"])))
                        self.guest.append((int(d["t"]) / 1e9, int(d["mem_bytes"])))

    def rate(self, a: float, b: float) -> float | None:
        pts = [p for p in self.points if a <= p[0] <= b]
        if len(pts) < 2:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    def guest_rate(self, a: float, b: float) -> float | None:
        """The rate by the guest's clock, over the lines the guest wrote between host
        times ``a`` and ``b``."""
        n = min(len(self.points), len(self.guest))
        if n < 2:
            return None
        offset = min(self.points[i][0] - self.guest[i][0] for i in range(n))
        pts = [g for g in self.guest[:n] if a <= g[0] + offset <= b]
        if len(pts) < 2:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


async def measure(d: Path, pid: int, kinds: list[str], repeats: int, gap: float,
                  rates: Rates) -> dict[str, Any]:
    end = Endpoint("g", d / "g.qmp", pid=pid)
    await end.connect(10)

    hmp = hmp_over(end.cmd)

    out: dict[str, Any] = {}
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for k in kinds:
        out[k] = {"wall_s": [], "cpu_s": [], "in_sample": [], "between": [],
                  "in_sample_guest": [], "between_guest": []}
    for _ in range(repeats):
        for k in kinds:
            reader = PmemsaveReader(end.cmd, pid, d) if k != "qemu" else None
            procmem = k in ("procmem", WIDE)
            mem = ProcMemReader(hmp, pid, reader) if reader and procmem else None
            sampler = (QemuSampler(end.cmd) if reader is None
                       else PeekSampler("procmem" if procmem else k, hmp, mem or reader,
                                        qmp=end.cmd, prepare=mem.prepare if mem else None))
            limits = encoding.CODEC_PAGES, encoding.ZLIB_PAGES
            if k == WIDE:
                encoding.CODEC_PAGES = encoding.ZLIB_PAGES = 1 << 20
            await asyncio.sleep(gap)
            t0, c0 = time.monotonic(), time.process_time()
            try:
                res = await sampler.sample()
            finally:
                encoding.CODEC_PAGES, encoding.ZLIB_PAGES = limits
            t1 = time.monotonic()
            out[k]["cpu_s"].append(round(time.process_time() - c0, 3))
            if mem is not None:
                mem.close()
            if reader is not None:
                reader.close()
            out[k]["wall_s"].append(round(res.wall_s, 3))
            out[k]["in_sample"].append(rates.rate(t0, t1))
            out[k]["between"].append(rates.rate(t0 - gap + 0.5, t0))
            windows[k].append((t0, t1))
    await asyncio.sleep(1.0)  # the last window's lines are in
    for k in kinds:  # by the guest's clock, with the offset from every line seen
        for t0, t1 in windows[k]:
            out[k]["in_sample_guest"].append(rates.guest_rate(t0, t1))
            out[k]["between_guest"].append(rates.guest_rate(t0 - gap + 0.5, t0))
    await end.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", default="4G")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=4.0)
    ap.add_argument("--samplers", default="qemu,procmem,pmemsave",
                    help="comma-separated: qemu (the patched build only), procmem, pmemsave, "
                    f"{WIDE} (procmem timing codecs on every kept page, as before)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="lm-samplecost-"))
    proc = start_qemu(d, "g", WORKLOAD, memory=a.memory)
    rates = Rates(d / "g.agent")
    try:
        time.sleep(8)
        rates.start()
        time.sleep(3)
        res = asyncio.run(measure(d, proc.pid, a.samplers.split(","), a.repeats, a.gap,
                                  rates))
    finally:
        rates.stop = True
        stop(proc)
    summary: dict[str, Any] = {"memory": a.memory, "workload": WORKLOAD,
                               "repeats": a.repeats, "samplers": {}}
    for k, v in res.items():
        loss = [1 - i / b for i, b in zip(v["in_sample"], v["between"], strict=True)
                if i is not None and b]
        gloss = [1 - i / b for i, b in zip(v["in_sample_guest"], v["between_guest"],
                                           strict=True) if i is not None and b]
        summary["samplers"][k] = {
            "wall_s_median": statistics.median(v["wall_s"]),
            "cpu_s_median": statistics.median(v["cpu_s"]),
            "guest_rate_loss_pct_median": round(100 * statistics.median(loss), 1)
            if loss else None,
            "guest_rate_loss_pct_median_guest_clock":
                round(100 * statistics.median(gloss), 1) if gloss else None, "runs": v}
        print(f"{a.memory} {k}: wall {statistics.median(v['wall_s']):.2f} s, this "
              f"process's CPU {statistics.median(v['cpu_s']):.3f} s, guest "
              f"throughput during the sample "
              f"{-100 * statistics.median(loss) if loss else float('nan'):+.1f} % "
              f"(by the guest's clock "
              f"{-100 * statistics.median(gloss) if gloss else float('nan'):+.1f} %)")
    if a.out:
        a.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
