"""Cross-storage migration: copy the disk to the destination's own image.

The destination exports its (empty) image over NBD; the source mirrors its disk
into that export with ``blockdev-mirror``. The RAM migration waits (disk first)
until the mirror's first full pass is done and the job is READY, and QEMU stops
at ``pre-switchover`` (capability ``pause-before-switchover``) so that the mirror
can finish while the guest is frozen: the switchover happens only with the two
images in sync. This is how libvirt does non-shared-storage migration.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from qemu.qmp import EventListener, QMPClient

from livemig.errors import VMError
from livemig.tls import qmp as tls_qmp

JOB = "livemig-mirror"
# the guest disk's QOM path (livemig.lab.vm: -device virtio-blk-pci,id=vdisk0; the block
# backend hangs off the inner virtio device): where the IO cap goes
GUEST_DISK = "/machine/peripheral/vdisk0/virtio-backend"
TARGET = "livemig-mirror-target"
EXPORT = "livemig-disk0"
NBD_PORT = 10809

Cmd = Callable[..., Awaitable[Any]]


@dataclass
class MirrorStats:
    started: float = 0.0
    ready_at: float | None = None
    finished_at: float | None = None
    offset_at_ready: int = 0
    guest_written_at_ready: int = 0
    offset_final: int | None = None
    guest_written_final: int | None = None

    def as_report(self) -> dict[str, Any]:
        after = None if self.offset_final is None else self.offset_final - self.offset_at_ready
        written = None
        if self.guest_written_final is not None:
            written = self.guest_written_final - self.guest_written_at_ready
        amp = None
        if after is not None and written:
            amp = round(after / written, 3)
        return {
            "disk_transferred_bytes": self.offset_final or 0,
            "disk_dirty_amplification": amp,
            "disk_detail": {
                "first_pass_s": None if self.ready_at is None else round(
                    self.ready_at - self.started, 3),
                "first_pass_bytes": self.offset_at_ready,
                "bytes_after_first_pass": after,
                "guest_bytes_written_after_first_pass": written,
                "total_s": None if self.finished_at is None else round(
                    self.finished_at - self.started, 3),
            },
        }


async def blockstats(cmd: Cmd, node: str = "disk0") -> dict[str, int]:
    """The guest disk's cumulative counters (query-blockstats): wr_bytes, ..."""
    for s in await cmd("query-blockstats"):
        if s.get("node-name") == node or "vdisk0" in str(s.get("qdev", "")):
            return {k: int(v) for k, v in s.get("stats", {}).items() if isinstance(v, int)}
    return {}


class DiskMirror:
    """One disk, mirrored from the source QEMU into the destination's NBD export."""

    def __init__(self, src: Cmd, dst: Cmd, dst_host: str, node: str, granularity: int,
                 speed: int, copy_mode: str, tls: bool = False) -> None:
        self.src, self.dst = src, dst
        self.tls = tls  # the export over TLS with the migration's credential objects
        self.dst_host = dst_host
        self.node = node
        self.granularity = granularity
        self.speed = speed
        self.copy_mode = copy_mode  # as set: background, write-blocking or ready
        self.mode_now = "background" if copy_mode == "ready" else copy_mode
        self.stats = MirrorStats()
        self.active = False

    async def start(self) -> None:
        addr = {"type": "inet", "host": self.dst_host, "port": str(NBD_PORT)}
        server_tls: dict[str, str] = {}
        client_tls: dict[str, str] = {}
        if self.tls:  # objects added with the migration's (livemig.tls.qmp)
            server_tls = {"tls-creds": tls_qmp.CREDS_ID, "tls-authz": tls_qmp.AUTHZ_ID}
            client_tls = {"tls-creds": tls_qmp.CREDS_ID, "tls-hostname": self.dst_host}
        # nbd-server-start still takes the legacy (boxed) socket address
        await self.dst("nbd-server-start", addr={"type": "inet", "data": dict(
            host=self.dst_host, port=str(NBD_PORT))}, **server_tls)
        await self.dst("block-export-add", type="nbd", id=EXPORT, **{"node-name": self.node},
                       name=EXPORT, writable=True)
        await self.src("blockdev-add", driver="nbd", **{"node-name": TARGET},
                       server=addr, export=EXPORT, **client_tls)
        self.stats.started = time.time()
        args: dict[str, Any] = {"job-id": JOB, "device": self.node, "target": TARGET,
                                "sync": "full", "granularity": self.granularity,
                                "copy-mode": self.mode_now}
        if self.speed:
            args["speed"] = self.speed
        await self.src("blockdev-mirror", **args)
        self.active = True

    async def job(self) -> dict[str, Any] | None:
        for j in await self.src("query-block-jobs"):
            if j.get("device") == JOB:
                return dict(j)
        return None

    async def guest_written(self) -> int:
        return (await blockstats(self.src)).get("wr_bytes", 0)

    async def poll(self) -> dict[str, Any] | None:
        """The job's state; records the end of the first full pass."""
        j = await self.job()
        if j is None:
            raise VMError("disk mirror job vanished: "
                          "the destination's NBD export may have gone away")
        if j.get("status") == "concluded" or j.get("error"):
            raise VMError(f"disk mirror failed: {j.get('error', j.get('status'))}")
        if j.get("ready") and self.stats.ready_at is None:
            self.stats.ready_at = time.time()
            self.stats.offset_at_ready = int(j["offset"])
            self.stats.guest_written_at_ready = await self.guest_written()
            if self.copy_mode == "ready":  # in sync: from now on each write goes to both
                await self.src("block-job-change", id=JOB, type="mirror",
                               **{"copy-mode": "write-blocking"})
                self.mode_now = "write-blocking"
        return j

    async def set_speed(self, speed: int) -> None:
        await self.src("block-job-set-speed", device=JOB, speed=speed)
        self.speed = speed

    async def finish(self, qmp: QMPClient, timeout: float = 120.0) -> None:
        """With the guest frozen: let the mirror catch up and end it, target in sync.

        ``block-job-cancel`` on a READY mirror completes it, leaving the target a
        point-in-time copy; its BLOCK_JOB_COMPLETED event carries the final count."""
        j = await self.poll()
        assert j is not None
        if not j.get("ready"):
            raise VMError("switchover reached with the disk mirror not in sync")
        self.stats.guest_written_final = await self.guest_written()
        listener = EventListener(("BLOCK_JOB_COMPLETED", "BLOCK_JOB_CANCELLED"))
        with qmp.listen(listener):
            await self.src("block-job-cancel", device=JOB)
            try:
                while True:
                    ev: dict[str, Any] = dict(await asyncio.wait_for(listener.get(),
                                                                      timeout))
                    data: dict[str, Any] = dict(ev.get("data", {}))
                    if data.get("device") == JOB:
                        break
            except TimeoutError:
                raise VMError(f"disk mirror did not finish within {timeout:.0f}s") from None
        if ev["event"] != "BLOCK_JOB_COMPLETED" or data.get("error"):
            raise VMError(f"disk mirror ended badly: {data.get('error', ev['event'])}")
        self.stats.offset_final = int(data["offset"])
        self.stats.finished_at = time.time()
        self.active = False
        await self.src("blockdev-del", **{"node-name": TARGET})

    async def stop_export(self) -> None:
        await self.dst("nbd-server-stop")

    async def abandon(self) -> None:
        """On failure: stop copying; the source keeps its own disk."""
        if self.active:
            try:
                await self.src("block-job-cancel", device=JOB, force=True)
                for _ in range(100):
                    if await self.job() is None:
                        break
                    await asyncio.sleep(0.02)
                await self.src("blockdev-del", **{"node-name": TARGET})
            except VMError:
                pass
            self.active = False
