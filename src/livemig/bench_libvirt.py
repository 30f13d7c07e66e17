"""``livemig bench --via libvirt``: a family's guest as a libvirt domain.

The testbed's per-host libvirt daemons run the guest (the lab's kernel and agent,
booted by libvirt from :func:`livemig.virt.domain.lab_domain_xml`, with the family's
memory and workload); ``livemig migrate --domain`` migrates it exactly as a user
runs it, in a child process. The bench measures around it what a report of a
libvirt run cannot know by itself: the guest's work, read from the agent's
virtio-serial channel (the socket libvirt names on each host), before, during and
after the migration, so the harm columns mean what they mean for the lab and attach
runs. The time the destination was held paused for the disk comparison is left out
of the harm, as the lab leaves out its verify hold.

What differs from an attach run, by construction: libvirt starts the destination
QEMU inside the migration (its begin/prepare phase is in ``total_time_s``), finishes
and confirms it after QEMU's switchover (also in ``total_time_s``; ``qemu_time_s`` is
QEMU's migration alone), and the stream goes over libvirt's own connection handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from livemig import libvirt_lab, metrics, paths
from livemig.errors import VMError
from livemig.lab.agent import AgentLink
from livemig.libvirt_lab import channel_path
from livemig.testbed import libvirtd
from livemig.units import parse_link_rate, parse_size

__all__ = ["LibvirtRun", "channel_path", "testbed"]

DISK_BYTES = 64 << 20  # a small raw disk on shared storage (RAM is what is measured)
BOOT_TIMEOUT_S = 120.0  # the agent's first workload counters after the domain starts
SETTLE_S = 2.0  # the guest's work measured this long after the migration ends
LAB_ONLY_SETS = ("warmup", "settle")  # the bench does the warm-up itself


class LibvirtRun:
    """One family/profile/repeat as a libvirt domain, migrated by the CLI."""

    def __init__(self, sc: dict[str, Any], profile: str, base: str, qemu: Path,
                 run_dir: Path, quiet: bool) -> None:
        self.sc = sc
        self.profile = profile
        self.base = base
        self.qemu = qemu
        self.run_dir = run_dir
        self.quiet = quiet
        self.name = f"lmb-{uuid.uuid4().hex[:8]}"
        self.image = libvirtd.shared_dir() / f"{self.name}.img"
        self.agents: list[AgentLink] = []

    def _cmd(self, report: Path) -> list[str]:
        sets = {k: str(v) for k, v in self.sc.get("set", {}).items()
                if k not in LAB_ONLY_SETS}
        # no link-rate: the run reads the link from the source host's route to the
        # destination (engine/linkprobe.py), as it does for a user's domain
        bandwidth = parse_size(str(self.sc["bandwidth"])) if self.sc.get("bandwidth") \
            else None
        return libvirt_lab.migrate_argv(self.name, report, profile=self.base, sets=sets,
                                        bandwidth=bandwidth,
                                        max_time=float(self.sc.get("max_time", 300)))

    async def run(self) -> dict[str, Any]:
        from livemig.virt.domain import lab_domain_xml

        with open(self.image, "wb") as f:
            f.truncate(DISK_BYTES)
        mib = parse_size(str(self.sc["memory"])) >> 20
        xml = lab_domain_xml(self.name, self.qemu, paths.guest_kernel(), paths.guest_initrd(),
                             str(self.image), memory_mib=mib, workload=str(self.sc["workload"]))
        c = libvirt_lab.conn("src")
        try:
            dom = c.defineXML(xml)
            dom.create()
            path = channel_path(dom.XMLDesc(0))
        finally:
            c.close()
        try:
            return await self._measure(path)
        finally:
            for a in self.agents:
                await a.close()
            self._cleanup()

    async def _agent(self, side: str, path: str) -> AgentLink:
        a = await libvirt_lab.connect_agent(side, path, BOOT_TIMEOUT_S)
        self.agents.append(a)
        return a

    async def _measure(self, src_path: str) -> dict[str, Any]:
        src = await self._agent("src", src_path)
        # the normal rate is measured from the agent's "ready" (memory filled, workload
        # threads started), as the lab does: its rate lines come from boot on, and the
        # fill before it made the baseline half the guest's rate (spread ~100 %) in the
        # first libvirt benches (docs/results/libvirt-2026-11-24)
        try:
            await asyncio.wait_for(src.ready.wait(), BOOT_TIMEOUT_S)
        except TimeoutError as e:
            raise VMError(f"{self.name}: the guest agent never said ready") from e
        t_ready = time.time()
        await asyncio.sleep(float(self.sc.get("set", {}).get("warmup", 5)))
        report_path = self.run_dir / f"{self.name}.json"
        t_migrate = time.time()
        proc = await asyncio.create_subprocess_exec(
            *self._cmd(report_path), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        follow = asyncio.create_task(self._follow_to_destination())
        try:
            out, err = await proc.communicate()
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        t_end = time.time()
        if not report_path.exists():
            raise VMError(f"livemig migrate --domain wrote no report (exit {proc.returncode}): "
                          f"{err.decode(errors='replace').strip()[-400:]}")
        rep: dict[str, Any] = json.loads(report_path.read_text())
        if not self.quiet:
            sys.stdout.write(out.decode(errors="replace"))
        await asyncio.sleep(SETTLE_S)
        rep["workload"] = self._workload(rep, t_ready, t_migrate, t_end)
        rep.update(self._pause(rep, t_migrate, t_end))
        rep["bench_child_exit"] = proc.returncode
        return rep

    async def _follow_to_destination(self) -> None:
        """The agent on the destination from libvirt's prepare phase on."""
        await libvirt_lab.follow_to("dst", self.name, BOOT_TIMEOUT_S, self.agents.append)

    def _rates(self) -> list[Any]:
        return sorted((s for a in self.agents for s in a.rates), key=lambda s: s.t)

    def _workload(self, rep: dict[str, Any], t_ready: float, t_migrate: float,
                  t_end: float) -> dict[str, Any]:
        wl: dict[str, Any] = {"spec": self.sc["workload"], "measured_by": "bench (agent "
                              "channel of the libvirt domain on each host)"}
        wl.update(metrics.workload_stats(self._rates(), t_ready, t_migrate, t_end,
                                         libvirt_lab.hold_window(rep, t_end)).as_dict())
        return wl

    def _pause(self, rep: dict[str, Any], t_migrate: float, t_end: float) -> dict[str, Any]:
        return libvirt_lab.guest_pause(self.agents, rep, t_migrate, t_end)

    def _cleanup(self) -> None:
        libvirt_lab.remove_domain(self.name)  # the bench's own guest
        with contextlib.suppress(OSError):
            self.image.unlink()


@contextlib.contextmanager
def testbed(link: str, emulators: list[Path]) -> Iterator[None]:
    """The testbed with its libvirt daemons, the link shaped for the family; held (the
    testbed lock) while the family runs. What this started is stopped after. The
    daemons know the family's emulators before the first run (libvirt_lab.warm), so no
    profile's run pays libvirt's probe of its emulator."""
    with libvirt_lab.testbed(parse_link_rate(link), owner="bench --via libvirt"):
        libvirt_lab.warm(emulators)
        yield
