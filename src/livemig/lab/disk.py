"""The lab's disk: images on the hosts and, with ``--storage copy``, the copy.

Shared storage: one image both hosts open. Copied storage: one image per host, the
destination's empty until the NBD mirror (:mod:`livemig.lab.storage`) fills it; the
mirror runs before (``disk-schedule=first``/``libvirt``) or with the RAM migration,
the disk policies see its backlog, and QEMU stops at ``pre-switchover`` so the mirror
finishes with the guest frozen.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from livemig.engine.events import EventStream
from livemig.errors import VMError
from livemig.lab.leftovers import RunState
from livemig.lab.storage import DiskMirror, blockstats
from livemig.lab.vm import VM, Disk
from livemig.policy.disk import choose_granularity
from livemig.spec import Workload

CATCH_UP_POLL_S = 0.1  # the frozen guest's wait for the mirror (downtime: poll often)


def make_images(workload: Workload, storage: str, run_dir: Path, size_default: int,
                fill: str, state: RunState, events: EventStream,
                images: tuple[Path, Path] | None = None, here: Path | None = None
                ) -> tuple[list[Path], Path | None, Path | None]:
    """Create the run's images; return (created, source image, destination image).

    ``images``: two images owned by the caller (ping-pong), ``here`` the one the
    running guest uses now."""
    w = workload
    if not (w.disk or (w.verify and w.verify.disk)):
        return [], None, None
    if images is not None:
        a, b = images
        here = here or a
        there = here if storage == "shared" else (b if here == a else a)
        return [], here, there
    need = max([d.size or 0 for d in w.disk] + [w.verify.disk if w.verify else 0])
    size = max(size_default, need)
    names = ["disk0.raw"] if storage == "shared" else ["src-disk0.raw", "dst-disk0.raw"]
    created: list[Path] = []
    for i, name in enumerate(names):
        img = run_dir / name
        with open(img, "wb") as f:
            f.truncate(size)
        if i == 0 and fill == "mixed":
            fill_image(img, size)
        created.append(img)
        state.add_file(img)
        events.event("disk created", path=str(img), size=size)
    return created, created[0], created[-1]


def disks(image: Path | None) -> list[Disk]:
    return [] if image is None else [Disk(image)]


class DiskCopy:
    """One disk copy: the mirror job, its observation, its finish."""

    def __init__(self, src: VM, dst: VM, dst_addr: str, settings: dict[str, Any],
                 events: EventStream, say: Callable[[str], None], tls: bool = False) -> None:
        self.src, self.dst, self.dst_addr = src, dst, dst_addr
        self.tls = tls
        self.settings = settings
        self.events, self.say = events, say
        self.mirror: DiskMirror | None = None
        self.job: dict[str, Any] | None = None
        self.obs: dict[str, Any] = {}  # what the disk policies see
        self._prev: tuple[float, int, int] | None = None  # (t, job len, guest written)

    @property
    def remaining(self) -> int | None:
        """Bytes the mirror still has to copy; None before its job has sized the disk
        (QEMU's first answer can be len 0, offset 0: not a finished copy)."""
        if self.job is None or self.mirror is None or not self.mirror.active \
                or not int(self.job["len"]):
            return None
        return int(self.job["len"]) - int(self.job["offset"])

    async def start(self) -> None:
        """Mirror the disk into the destination's NBD export."""
        lm = self.settings
        gran = lm["disk-granularity"]
        why = "set explicitly"
        if gran == "auto":
            st = await blockstats(self.src.cmd)
            gran = choose_granularity(st.get("wr_bytes", 0), st.get("wr_operations", 0))
            avg = st.get("wr_bytes", 0) / max(st.get("wr_operations", 0), 1)
            why = (f"auto: guest writes average {avg / 1024:.1f} KiB over "
                   f"{st.get('wr_operations', 0)} writes")
        m = DiskMirror(self.src.cmd, self.dst.cmd, self.dst_addr, "disk0", int(gran),
                       int(lm["disk-speed"]), str(lm["disk-copy-mode"]), tls=self.tls)
        self.mirror = m
        await m.start()
        self.events.event("disk mirror started", granularity=m.granularity,
                          granularity_reason=why, speed=m.speed, copy_mode=m.copy_mode,
                          schedule=lm["disk-schedule"])
        self.say(f"copying the disk (granularity {m.granularity >> 10}K, {why}; mode "
                 f"{m.copy_mode}, schedule {lm['disk-schedule']})")

    async def poll(self, now: float) -> None:
        assert self.mirror is not None
        first_pass = self.mirror.stats.ready_at is None
        self.job = job = await self.mirror.poll()
        if first_pass and job is not None and self.mirror.stats.ready_at is not None:
            self.events.event("disk mirror ready", offset=job["offset"], len=job["len"],
                              copy_mode=self.mirror.mode_now)
        await self.observe(now)

    async def observe(self, now: float) -> None:
        """The mirror's backlog, how fast it is re-dirtied, how fast the guest writes."""
        assert self.mirror is not None
        job = self.job
        if job is None:
            return
        written = await self.mirror.guest_written()
        obs: dict[str, Any] = {"remaining": int(job["len"]) - int(job["offset"]),
                               "total": int(job["len"]), "ready": bool(job.get("ready"))}
        if self._prev is not None and now > self._prev[0]:
            dt = now - self._prev[0]
            obs["dirty_rate"] = max(0, int(job["len"]) - self._prev[1]) / dt
            obs["write_rate"] = max(0, written - self._prev[2]) / dt
        self._prev = (now, int(job["len"]), written)
        self.obs = obs

    async def switchover(self, check: Callable[[], None]) -> None:
        """QEMU paused at pre-switchover: finish the mirror, then let RAM complete."""
        assert self.mirror is not None and self.src.qmp is not None
        self.say("guest frozen: finishing the disk mirror before the switchover")
        if self.mirror.stats.ready_at is None:  # concurrent: RAM was done first
            await self._catch_up(check)
        await self.mirror.finish(self.src.qmp)
        self.events.event("disk mirror finished", **self.mirror.stats.as_report())
        await self.src.cmd("migrate-continue", state="pre-switchover")

    async def _catch_up(self, check: Callable[[], None]) -> None:
        """Concurrent schedule, RAM done before the mirror's first pass: wait for it
        with the guest frozen. A wait of its own, not the engine monitor's ticks (which
        hold ``migrate`` while a disk copied first is not ready): here the monitor is
        itself waiting in its pre-switchover hook, every moment is guest downtime (so
        this polls at ``CATCH_UP_POLL_S``, not at the monitor's period), and no policy
        has anything to act on (the frozen guest writes nothing, no RAM moves)."""
        assert self.mirror is not None
        last_report = 0.0
        while True:
            now = time.time()
            await self.poll(now)
            job = self.job
            assert job is not None
            if job.get("ready"):
                return
            if now - last_report >= 1.0:
                last_report = now
                self.say(f"disk: {job['offset'] >> 20} of {job['len'] >> 20} MiB copied")
            check()
            if not self.dst.alive():
                raise VMError(f"destination QEMU died: {self.dst.log_tail()}")
            await asyncio.sleep(CATCH_UP_POLL_S)


def fill_image(path: Path, size: int) -> None:
    """Fill a disk image like a used disk: per 4 KiB block a mix of random, text-like
    and zero blocks (the mirror copies every byte; compressibility does not matter)."""
    rng = random.Random(0x11FE)
    words = b"lorem ipsum dolor sit amet select from where index page row table "
    blocks = []
    for i in range(256):
        kind = i % 4
        if kind == 0:
            blocks.append(rng.randbytes(4096))
        elif kind == 3:
            blocks.append(bytes(4096))
        else:
            blocks.append((words * 64)[rng.randrange(64):][:4096].ljust(4096, b" "))
    chunk = b"".join(blocks)  # 1 MiB
    with open(path, "r+b") as f:
        for off in range(0, size, len(chunk)):
            f.write(off.to_bytes(8, "little") + chunk[8:min(len(chunk), size - off)])


