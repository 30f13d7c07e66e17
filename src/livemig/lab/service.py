"""A service guest in the lab (``pgbench:`` / ``redis:`` workloads, issue #13).

The guest is a Debian rootfs image (guest/rootfs/) booted with the lab's kernel and
initramfs; the lab's agent still runs in it (idle) for heartbeats, readiness and the
client's probes. Its throughput is what its load generator on the testbed's client
host completes every second; that series replaces the agent's counters in the
timeline and the report.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from livemig.errors import UsageError, VMError
from livemig.lab.leftovers import RunState
from livemig.services import guest as service_guest
from livemig.services.client import LoadProcess
from livemig.services.figures import client_workload
from livemig.spec import ServiceLoad
from livemig.testbed import netns, topology

PORTS = {"pgbench": 5432, "redis": 6379}
READY_TIMEOUT_S = 180.0
RECOVERY_S = 3  # a stretch of this many seconds says what the service came back to


class ServiceRun:
    def __init__(self, svc: ServiceLoad, say: Callable[[str], None]) -> None:
        self.svc = svc
        self.say = say
        self.load: LoadProcess | None = None
        self.t_load: float | None = None  # first second the client reported

    @staticmethod
    def check(svc: ServiceLoad, testbed: bool) -> None:
        if not testbed:
            raise UsageError(f"a {svc.kind} workload is measured from the testbed's client "
                             "host: not with --link local")

    # -- images -----------------------------------------------------------------------
    def make_images(self, storage: str, run_dir: Path,
                    state: RunState) -> tuple[list[Path], Path, Path]:
        """A private copy of the service's image for this run (both hosts open it with
        shared storage; with copied storage the destination gets an empty image of the
        same size that the mirror fills). Returns (created, source, destination)."""
        self.say(f"{self.svc.image} guest image (built once, cached)")
        image = service_guest.ensure_image(self.svc)
        src = run_dir / ("root-src.raw" if storage == "copy" else "root.raw")
        state.add_file(src)
        service_guest.copy_image(image, src)
        if storage != "copy":
            return [src], src, src
        dst = run_dir / "root-dst.raw"
        state.add_file(dst)
        with open(dst, "wb") as f:
            f.truncate(src.stat().st_size)
        return [src, dst], src, dst

    @staticmethod
    def kernel_append() -> str:
        return f"livemig.workload=idle {service_guest.kernel_append()}"

    # -- load -------------------------------------------------------------------------
    async def start(self, check_interrupt: Callable[[], None], console: Path | None) -> float:
        """Wait until the service answers on the guest network, start the client's
        load, wait for its first second; return that time (the normal rate's start)."""
        port = PORTS[self.svc.kind]
        client = topology.HOSTS["client"]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not await _port_open(client, port):
            check_interrupt()
            if time.monotonic() > deadline:
                raise VMError(f"{self.svc.kind}: the service does not answer on "
                              f"{topology.GUEST_IP}:{port} (console: {console})")
            await asyncio.sleep(0.5)
        self.load = service_guest.start_load(self.svc, netns.exec_prefix(client),
                                             topology.GUEST_IP)
        self.say(f"{self.svc.kind} load from the client host: {self.svc.clients} clients")
        while not self.load.series.ticks:
            check_interrupt()
            if not self.load.alive():
                msgs = "; ".join(self.load.series.messages[-2:]) or "it exited"
                raise VMError(f"{self.svc.kind} load generator: {msgs}")
            if time.monotonic() > deadline:
                raise VMError(f"{self.svc.kind} load generator reported nothing")
            await asyncio.sleep(0.2)
        self.t_load = time.time()
        return self.t_load

    def samples(self) -> list[Any]:
        return list(self.load.series.samples()) if self.load is not None else []

    async def stop(self) -> None:
        if self.load is not None:
            await asyncio.to_thread(self.load.stop)

    # -- figures ----------------------------------------------------------------------
    def workload(self, t_ready: float, t_migrate: float, t_end: float,
                 hold: tuple[float, float] | None, t_cont: float | None) -> dict[str, Any]:
        assert self.load is not None
        wl = client_workload(self.load.series, service_guest.unit(self.svc), t_ready,
                             t_migrate, t_end, hold)
        wl["after_switchover_pct"] = self._after_switchover_pct(wl["baseline_rate"], t_cont)
        return wl

    def _after_switchover_pct(self, base: float | None,
                              t_cont: float | None) -> float | None:
        """The rate the service came back to after the guest resumed on the
        destination, in % of normal: the best RECOVERY_S-second stretch (its median)
        after the resume. A fresh TCG destination translates its code anew, so its
        first seconds are slow, and a loaded host makes single seconds swing; a
        service that never recovers has no good stretch."""
        if self.load is None or t_cont is None:
            return None
        ticks = [tk.ops for tk in self.load.series.ticks if tk.t > t_cont + 1.0]
        if not base or not ticks:
            return None
        n = min(RECOVERY_S, len(ticks))
        best = max(statistics.median(ticks[i:i + n]) for i in range(len(ticks) - n + 1))
        return round(100.0 * best / base, 1)


async def _port_open(ns: str, port: int) -> bool:
    proc = await asyncio.create_subprocess_exec(
        *netns.exec_prefix(ns), "bash", "-c",
        f"exec 3<>/dev/tcp/{topology.GUEST_IP}/{port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await proc.wait() == 0
