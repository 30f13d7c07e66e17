"""``livemig verify``: one guest migrated back and forth between the testbed's hosts.

Every migration (hop) uses the next feature combination, runs the host's exact RAM
comparison (and the disk image comparison when the disk is copied), while the guest's
stamp-and-verify checker watches its own memory and disk across every hop. With
``--inject KIND`` each hop also corrupts the destination on purpose, and the summary
counts how many of those faults the host comparison and the guest checker named.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig import paths, private
from livemig.lab.faults import Fault
from livemig.lab.run import LabRun, MigrateOptions, Running
from livemig.progress import Progress
from livemig.settings import merge
from livemig.spec import parse_workload
from livemig.testbed import topology

DEFAULT_WORKLOAD = ("verify:mem=64M,disk=32M+mem:size=128M,rate=32M,hot=80/10"
                    "+disk:bs=8K,rate=1M")
INJECT_KINDS = ("ram-stamped", "disk-stamped")
GUEST_DETECT_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Combination:
    sets: dict[str, str] = field(default_factory=dict)
    link: int | None = 1_000_000_000
    storage: str = "shared"
    bandwidth: int | None = None


COMBINATIONS: dict[str, Combination] = {
    "plain": Combination(),
    "multifd-2": Combination({"multifd-channels": "2"}),
    "multifd-4": Combination({"multifd-channels": "4"}),
    "zstd": Combination({"multifd-compression": "zstd", "multifd-channels": "2"}),
    "lz4": Combination({"multifd-compression": "lz4", "multifd-channels": "2"}),
    "lz4-bypass": Combination({"multifd-compression": "lz4", "multifd-channels": "2",
                               "multifd-compress-bypass-percent": "60"}),
    "hot-page-defer": Combination({"x-hot-page-defer-percent": "30"}, bandwidth=48 << 20),
    "direct-throttle": Combination({"throttle": "direct"}, bandwidth=24 << 20),
    "storage-copy": Combination(storage="copy"),
    "plain-unshaped": Combination(link=None),
    "lz4-unshaped": Combination({"multifd-compression": "lz4", "multifd-channels": "2"},
                                link=None),
}


@dataclass
class VerifyOptions:
    rounds: int
    combinations: list[str]
    memory: int
    workload: str
    qemu: Path
    accel: str
    accel_reason: str
    inject: str | None = None
    max_time: float = 180.0


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

    def as_dict(self) -> dict[str, Any]:
        r = self.report
        cons = r.get("consistency", {})
        return {
            "index": self.index, "combination": self.combination,
            "from": self.src, "to": self.dst, "outcome": r.get("outcome"),
            "reason": r.get("reason"), "total_time_s": r.get("total_time_s"),
            "guest_pause_ms": r.get("guest_pause_ms"),
            "network_pause_ms": r.get("network_pause_ms"),
            "ram": cons.get("ram"), "disk": cons.get("disk"),
            "guest": "mismatch" if self.guest_errors else cons.get("guest"),
            "injected": self.injected, "detected_by_host": self.detected_by_host,
            "detected_by_guest": self.detected_by_guest, "mismatches": self.unexplained,
        }


class PingPong:
    def __init__(self, opts: VerifyOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.id = "v" + uuid.uuid4().hex[:7]
        self.dir = paths.run_root() / self.id
        self.hops: list[Hop] = []
        self.interrupted = False
        self.current: LabRun | None = None
        self.running: Running | None = None
        self.images: tuple[Path, Path] | None = None

    def interrupt(self) -> None:
        self.interrupted = True
        if self.current is not None:
            self.current.interrupt.set()

    async def run(self) -> dict[str, Any]:
        with topology.locked():
            created = not topology.is_up()
            if created:
                self.say("creating the testbed hosts (network namespaces)")
                topology.up(1_000_000_000, owner=f"verify {self.id}")
            try:
                await self._soak()
            finally:
                await self._stop_guest()
                for img in self.images or ():
                    with contextlib.suppress(FileNotFoundError):
                        img.unlink()
                with contextlib.suppress(OSError):
                    self.dir.rmdir()
                if created:
                    topology.down(quiet=True)
        return self.summary()

    async def _soak(self) -> None:
        o = self.opts
        workload = parse_workload(o.workload)
        private.make_dir(self.dir)
        size = max(64 << 20, *(d.size or 0 for d in workload.disk),
                   workload.verify.disk if workload.verify else 0)
        self.images = (self.dir / "host-a-disk0.raw", self.dir / "host-b-disk0.raw")
        for img in self.images:
            with open(img, "wb") as f:
                f.truncate(size)
        names = o.combinations
        if o.inject and o.inject.startswith("disk"):
            names = [n for n in names if COMBINATIONS[n].storage == "copy"]
        for i in range(o.rounds):
            if self.interrupted:
                break
            name = names[i % len(names)]
            src = self.running.host if self.running else "src"
            hop = Hop(i + 1, name, src, "dst" if src == "src" else "src")
            self.hops.append(hop)
            await self._hop(hop, workload)
            self.say(_hop_line(hop, o.rounds))
            if hop.report.get("outcome") != "completed":
                self.say("stopping: the guest did not move (it runs on where it was)")
                break

    async def _hop(self, hop: Hop, workload: Any) -> None:
        o = self.opts
        c = COMBINATIONS[hop.combination]
        faults = []
        if o.inject:
            faults = [Fault(o.inject, hop.index * 7919)]
        mopts = MigrateOptions(
            workload=workload, memory=o.memory, vcpus=1, bandwidth=c.bandwidth,
            profile="defaults", wanted=merge("defaults", {"warmup": "1", "settle": "1",
                                                          **c.sets}),
            max_time=o.max_time, qemu=o.qemu, accel=o.accel, accel_reason=o.accel_reason,
            verify=True, faults=faults, run_id=f"{self.id}-{hop.index}",
            resume_corrupt=bool(faults),  # the guest checker must meet the fault too
            testbed=True, link=c.link, storage=c.storage, src_host=hop.src,
            dst_host=hop.dst, source=self.running, keep_destination=True,
            images=self.images, testbed_held=True,
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
        handed = mig.handed_over()
        if handed is not None:
            self.running = handed
        elif self.running is not None and not self.running.vm.alive():
            self.running = None
        elif mig.src is not None and mig.src.alive() and mig.src_agent is not None:
            # failed before the switchover: the source runs on where it was
            self.running = Running(mig.src, mig.src_agent, hop.src, mig._src_image)
        await self._tally(hop)

    async def _tally(self, hop: Hop) -> None:
        """Match what the host and the guest reported against what was injected."""
        r = hop.report
        cons = r.get("consistency", {})
        ram_bad = set(cons.get("ram_detail", {}).get("first_mismatches", []))
        disk_bad = set(cons.get("disk_detail", {}).get("first_mismatches", []))
        n_ram = cons.get("ram_detail", {}).get("mismatched_pages", 0)
        n_disk = cons.get("disk_detail", {}).get("mismatched_blocks", 0)
        for f in hop.injected:
            bad = ram_bad if f["target"] == "ram" else disk_bad
            page = f["block"]
            if page in bad:
                hop.detected_by_host += 1
                if f["target"] == "ram":
                    n_ram -= 1
                else:
                    n_disk -= 1
        guest = await self._guest_errors(hop)
        hop.guest_errors = len(guest)
        matched = 0
        for f in hop.injected:
            kind = "mem" if f["target"] == "ram" else "disk"
            if any(e.get("kind") == kind and int(e.get("addr", -1)) == int(f["block"], 16)
                   for e in guest):
                hop.detected_by_guest += 1
                matched += 1
        hop.unexplained = max(n_ram, 0) + max(n_disk, 0) + max(len(guest) - matched, 0)

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

    async def _stop_guest(self) -> None:
        if self.running is None:
            return
        await self.running.agent.close()
        with contextlib.suppress(Exception):
            await self.running.vm.stop()
        with contextlib.suppress(FileNotFoundError):
            self.running.vm.config.mem_path.unlink()
        shutil.rmtree(self.running.vm.config.run_dir, ignore_errors=True)
        self.running = None

    def summary(self) -> dict[str, Any]:
        by: dict[str, dict[str, int]] = {}
        for h in self.hops:
            b = by.setdefault(h.combination, {"migrations": 0, "completed": 0,
                                              "mismatches": 0})
            b["migrations"] += 1
            b["completed"] += h.report.get("outcome") == "completed"
            b["mismatches"] += h.unexplained
        injected = sum(len(h.injected) for h in self.hops)
        by_host = sum(h.detected_by_host for h in self.hops)
        by_guest = sum(h.detected_by_guest for h in self.hops)
        return {
            "run_id": self.id,
            "migrations": len(self.hops),
            "completed": sum(h.report.get("outcome") == "completed" for h in self.hops),
            "mismatches": sum(h.unexplained for h in self.hops),
            "by_combination": by,
            "inject": self.opts.inject,
            "injected": injected,
            # a fault counts as detected when the host comparison named it and, for
            # faults in the checker's blocks, the guest checker named it too
            "detected": sum(min(h.detected_by_host, h.detected_by_guest) for h in self.hops),
            "detected_by_host": by_host,
            "detected_by_guest": by_guest,
            "interrupted": self.interrupted,
            "hops": [h.as_dict() for h in self.hops],
        }


def _hop_line(h: Hop, rounds: int) -> str:
    d = h.as_dict()
    line = (f"[{h.index}/{rounds}] {h.combination:15} {h.src}->{h.dst}  {d['outcome']:9} "
            f"RAM {d['ram']}, disk {d['disk']}, guest {d['guest']}")
    if d["total_time_s"] is not None:
        line += f"  {d['total_time_s']:.1f}s"
    if h.injected:
        line += (f"  injected {len(h.injected)}: host named {h.detected_by_host}, "
                 f"guest named {h.detected_by_guest}")
    if d["outcome"] != "completed":
        line += f"  ({d['reason']})"
    return line
