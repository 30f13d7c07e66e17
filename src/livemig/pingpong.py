"""One lab guest shuttled between the testbed's hosts, one verified migration (hop) at a time.

The machinery under ``livemig verify`` and ``livemig soak``: the guest boots with the
first hop and is handed from each migration's destination to the next one's source;
every hop compares RAM (and the disk when copied) exactly while the guest's
stamp-and-verify checker watches its own memory and disk. A hop may carry one injected
fault; :func:`tally` matches what the host comparison and the guest checker named
against it, so that anything they named beyond the fault counts as a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig import paths, private
from livemig.errors import VMError
from livemig.lab.agent import AgentLink
from livemig.lab.faults import Fault
from livemig.lab.run import LabRun, MigrateOptions, Running
from livemig.progress import Progress
from livemig.settings import merge
from livemig.spec import Workload, parse_workload
from livemig.testbed import topology

# How long the guest checker gets to report an injected fault after the destination
# resumed: it re-reads its whole region in well under a second at its default rate;
# 15 s leaves room for a loaded 2-core TCG host.
GUEST_DETECT_TIMEOUT_S = 15.0
# A load change restarts the agent's workload, which fills and stamps its regions
# before it says "ready": a few seconds under TCG for tens of MiB.
LOAD_READY_TIMEOUT_S = 60.0
MIN_IMAGE = 64 << 20  # the lab's smallest disk image


@dataclass(frozen=True)
class Combination:
    """One way to migrate: settings over a profile, the link, storage and a cap."""

    sets: dict[str, str] = field(default_factory=dict)
    link: int | None = 1_000_000_000  # bits/s of the shaped link; None: unshaped
    storage: str = "shared"
    bandwidth: int | None = None  # bytes/s cap on the migration stream
    profile: str = "defaults"
    via: str = "lab"  # lab: the lab's engine hooks; attach: the path users' VMs take


@dataclass(frozen=True)
class ShuttleConfig:
    memory: int
    # the guest's boot load: it also fixes the guest's devices (a disk when it has a
    # disk item or the checker's disk) for the session; later loads: Shuttle.set_load
    workload: str
    qemu: Path
    accel: str
    accel_reason: str
    max_time: float = 180.0
    warmup: float = 1.0  # seconds: the lab's rate baseline before each hop
    settle: float = 1.0  # seconds the guest is watched after each hop


@dataclass
class Hop:
    index: int
    combination: str
    src: str
    dst: str
    report: dict[str, Any] = field(default_factory=dict)
    injected: list[dict[str, Any]] = field(default_factory=list)
    detected_by_host: int = 0
    detected_by_guest: int = 0
    unexplained: int = 0
    guest_errors: int = 0
    t0: float = 0.0  # when the hop began (guest reports before it belong to earlier hops)
    wall_s: float = 0.0  # the whole hop: boot (first hop), migration, checks, tally
    guest_lost: bool = False  # neither end runs the guest after the hop
    checker: bool = True  # the guest's load includes the stamp-and-verify checker

    def as_dict(self) -> dict[str, Any]:
        r = self.report
        cons = r.get("consistency", {})
        guest = cons.get("guest") if self.checker else "n/a"
        return {
            "index": self.index, "combination": self.combination,
            "from": self.src, "to": self.dst, "outcome": r.get("outcome"),
            "reason": r.get("reason"), "total_time_s": r.get("total_time_s"),
            "guest_pause_ms": r.get("guest_pause_ms"),
            "network_pause_ms": r.get("network_pause_ms"),
            "ram": cons.get("ram"), "disk": cons.get("disk"),
            "guest": "mismatch" if self.guest_errors else guest,
            "injected": self.injected, "detected_by_host": self.detected_by_host,
            "detected_by_guest": self.detected_by_guest, "mismatches": self.unexplained,
        }


class Shuttle:
    """The guest, its disk images and the testbed for the length of a ping-pong."""

    def __init__(self, cfg: ShuttleConfig, prefix: str = "v") -> None:
        self.cfg = cfg
        self.id = prefix + uuid.uuid4().hex[:7]
        self.dir = paths.run_root() / self.id
        self.interrupted = False
        self.current: LabRun | None = None
        self.running: Running | None = None
        self.images: tuple[Path, Path] | None = None
        self.boot: Workload = parse_workload(cfg.workload)
        self.workload: Workload = self.boot  # the load the guest runs now

    def interrupt(self) -> None:
        """Ctrl-C: abort the hop under way (its source runs on) and start no other."""
        self.interrupted = True
        if self.current is not None:
            self.current.interrupt.set()

    @contextlib.asynccontextmanager
    async def session(self, say: Callable[[str], None],
                      image_size: int = 0) -> AsyncIterator[Shuttle]:
        """The testbed (created if down), two disk images; the guest stopped at the end."""
        with topology.locked():
            created = not topology.is_up()
            if created:
                say("creating the testbed hosts (network namespaces)")
                topology.up(1_000_000_000, owner=f"ping-pong {self.id}")
            try:
                self._make_images(image_size)
                yield self
            finally:
                await self.stop_guest()
                for img in self.images or ():
                    with contextlib.suppress(FileNotFoundError):
                        img.unlink()
                with contextlib.suppress(OSError):
                    self.dir.rmdir()
                if created:
                    topology.down(quiet=True)

    def _make_images(self, image_size: int) -> None:
        w = self.boot
        size = max(MIN_IMAGE, image_size, *(d.size or 0 for d in w.disk),
                   w.verify.disk if w.verify else 0)
        private.make_dir(self.dir)
        self.images = (self.dir / "host-a-disk0.raw", self.dir / "host-b-disk0.raw")
        for img in self.images:
            with open(img, "wb") as f:
                f.truncate(size)

    async def set_load(self, text: str) -> None:
        """Change the running guest's load (the agent restarts its workload, checker too).

        The guest's devices stay those of its boot load: a load that writes to a disk
        needs a boot load with one."""
        spec = parse_workload(text)
        if self.running is None:
            raise VMError("no guest runs yet: its first load is the boot load")
        if (spec.disk or (spec.verify and spec.verify.disk)) and not (
                self.boot.disk or (self.boot.verify and self.boot.verify.disk)):
            raise VMError(f"load {spec.text!r} needs a disk the guest was booted without")
        await change_load(self.running.agent, spec)
        self.workload = spec

    async def hop(self, index: int, name: str, c: Combination,
                  fault: Fault | None = None) -> Hop:
        """Migrate the guest to the other host with combination ``c``; verify; tally."""
        t_start = time.monotonic()
        src = self.running.host if self.running else "src"
        hop = Hop(index, name, src, "dst" if src == "src" else "src",
                  checker=self.workload.verify is not None)
        faults = [fault] if fault is not None else []
        mopts = MigrateOptions(
            workload=self.boot, memory=self.cfg.memory, vcpus=1, bandwidth=c.bandwidth,
            profile=c.profile,
            wanted=merge(c.profile, {"warmup": f"{self.cfg.warmup:g}",
                                     "settle": f"{self.cfg.settle:g}", **c.sets}),
            max_time=self.cfg.max_time, qemu=self.cfg.qemu, accel=self.cfg.accel,
            accel_reason=self.cfg.accel_reason, verify=True, faults=faults,
            run_id=f"{self.id}-{index}",
            resume_corrupt=bool(faults),  # the guest checker must meet the fault too
            testbed=True, link=c.link, storage=c.storage, src_host=hop.src,
            dst_host=hop.dst, source=self.running, keep_destination=True,
            images=self.images, testbed_held=True, via=c.via, attach_monitor=True,
        )
        mig = LabRun(mopts, Progress(enabled=False))
        self.current = mig
        try:
            await mig.run()
        finally:
            self.current = None
        hop.t0 = mig.t0
        hop.report = mig.report()
        hop.injected = list(mig.injected)
        # completed: the destination; failed or aborted: the source runs on where it was;
        # failed before the run took the guest over (a missing QEMU binary): untouched
        before = self.running
        self.running = mig.handed_over() or mig.source_kept()
        if self.running is None and before is not None and mig.src is None \
                and before.vm.alive():
            self.running = before
        if self.running is None:  # the next guest boots with the boot load
            self.workload = self.boot
        hop.guest_lost = self.running is None
        await self._tally(hop)
        hop.wall_s = time.monotonic() - t_start
        return hop

    async def _tally(self, hop: Hop) -> None:
        guest = await self._guest_errors(hop)
        tally(hop, guest)

    async def _guest_errors(self, hop: Hop) -> list[dict[str, Any]]:
        """The guest checker's reports since the hop began (waiting for injected ones)."""
        agent = self.running.agent if self.running else None
        if agent is None:
            return []
        if hop.injected:
            t_inj = min(f["t"] for f in hop.injected)
            deadline = time.monotonic() + GUEST_DETECT_TIMEOUT_S
            while time.monotonic() < deadline and len(
                    [e for e in agent.verify_errors if e["t"] >= t_inj]) < len(hop.injected):
                await asyncio.sleep(0.1)
        return [e for e in agent.verify_errors if e["t"] >= hop.t0]

    async def stop_guest(self) -> None:
        """Shut down the guest livemig booted (and remove its RAM file and run dir)."""
        if self.running is None:
            return
        await self.running.agent.close()
        with contextlib.suppress(Exception):
            await self.running.vm.stop()
        with contextlib.suppress(FileNotFoundError):
            self.running.vm.config.mem_path.unlink()
        shutil.rmtree(self.running.vm.config.run_dir, ignore_errors=True)
        self.running = None


async def change_load(agent: AgentLink, spec: Workload) -> None:
    """Have the guest's agent restart its workload as ``spec`` (the checker re-stamps
    its regions) and wait for its "ready"; VMError if it refuses or never says it."""
    agent.ready.clear()
    n_err = len(agent.errors)
    await agent.send(f"workload {spec.text}")
    try:
        await asyncio.wait_for(agent.ready.wait(), LOAD_READY_TIMEOUT_S)
    except TimeoutError:
        raise VMError(f"the guest did not start load {spec.text!r} within "
                      f"{LOAD_READY_TIMEOUT_S:.0f}s") from None
    if len(agent.errors) > n_err:
        raise VMError(f"the guest refused load {spec.text!r}: {agent.errors[-1]}")


def tally(hop: Hop, guest: list[dict[str, Any]]) -> None:
    """Match what the host and the guest reported against what was injected.

    A fault counts for the host when its page/block is among the first mismatches the
    comparison named, for the guest when the checker reported that address; whatever
    either named beyond the faults is an unexplained mismatch."""
    cons = hop.report.get("consistency", {})
    ram_bad = set(cons.get("ram_detail", {}).get("first_mismatches", []))
    disk_bad = set(cons.get("disk_detail", {}).get("first_mismatches", []))
    n_ram = cons.get("ram_detail", {}).get("mismatched_pages", 0)
    n_disk = cons.get("disk_detail", {}).get("mismatched_blocks", 0)
    for f in hop.injected:
        bad = ram_bad if f["target"] == "ram" else disk_bad
        if f["block"] in bad:
            hop.detected_by_host += 1
            if f["target"] == "ram":
                n_ram -= 1
            else:
                n_disk -= 1
    hop.guest_errors = len(guest)
    matched = 0
    for f in hop.injected:
        kind = "mem" if f["target"] == "ram" else "disk"
        if any(e.get("kind") == kind and int(e.get("addr", -1)) == int(f["block"], 16)
               for e in guest):
            hop.detected_by_guest += 1
            matched += 1
    hop.unexplained = max(n_ram, 0) + max(n_disk, 0) + max(len(guest) - matched, 0)


def hop_line(h: Hop, total: int | None) -> str:
    """One progress line per hop."""
    d = h.as_dict()
    of = f"/{total}" if total else ""
    line = (f"[{h.index}{of}] {h.combination:15} {h.src}->{h.dst}  {d['outcome']:9} "
            f"RAM {d['ram']}, disk {d['disk']}, guest {d['guest']}")
    if d["total_time_s"] is not None:
        line += f"  {d['total_time_s']:.1f}s"
    if h.injected:
        line += (f"  injected {len(h.injected)}: host named {h.detected_by_host}, "
                 f"guest named {h.detected_by_guest}")
    if d["outcome"] != "completed":
        line += f"  ({d['reason']})"
    if h.guest_lost:
        line += "  GUEST LOST"
    return line
