"""A libvirt domain shuttled between the testbed's two libvirt daemons, hop by hop.

The soak's ``--path libvirt``: the same role as :class:`livemig.pingpong.Shuttle`
(``session``, ``set_load``, ``hop``, ``running``), for the way users run. The domain
is livemig's own: the lab's kernel, agent and workload booted by libvirt from
:func:`livemig.virt.domain.lab_domain_xml`, defined and started on src by the first
hop, and each hop is ``livemig migrate --domain NAME --connect SRC --to DST`` in a
child process, exactly as a user runs it (its report is the hop's report).

Verdicts: the report's ``consistency.ram`` (the patched build's in-stream digest) and
``consistency.disk`` (the NBD comparison of a copied disk, ``disk-check=nbd``: the
default) are the host's; the guest checker's ``verify_error`` events, read from the
agent's channel on both hosts (followed onto the destination while the migration
runs), are the checker's. The guest-visible pause is the longest gap in the agent's
heartbeats, less the destination's hold for the disk comparison.

Storage: the domain's disk is ``/var/lib/libvirt/images/NAME.img``, a directory each
daemon has of its own. Before a copied hop the destination's stale copy is removed
(libvirt pre-creates it and its NBD mirror fills it); before a shared hop the
destination's name is made a hard link to the source's image — one file both hosts
see, as on a shared file system (passed ``--unsafe``, which libvirt needs when it
cannot tell that storage is shared).

No fault injection: faults are injected by the lab's verify hold, a lab hook a libvirt
migration (like a user's) does not have; ``--inject-every`` applies to lab hops only.

A hop that fails leaves the domain where it was (libvirt's own rollback: the source
runs on) and the soak goes on. At the end the domain is destroyed and undefined and
its images removed; on Ctrl-C the hop under way is aborted and the domain is left
running on the host it is on (said, with the daemon's URI), the daemons with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from livemig import libvirt_lab, paths, private
from livemig.errors import VMError
from livemig.lab.agent import AgentLink
from livemig.lab.faults import Fault
from livemig.pingpong import MIN_IMAGE, Combination, Hop, ShuttleConfig, change_load
from livemig.spec import Workload, parse_workload
from livemig.testbed import libvirtd, topology
from livemig.units import parse_link_rate

MiB = 1 << 20
# The domain's boot to the agent's "ready" (the workload's regions filled and stamped)
# under TCG on a loaded 2-core host.
BOOT_TIMEOUT_S = 120.0
# The child ``livemig migrate`` gets --max-time; this much more before it is killed
# (its own abort, libvirt's rollback and the report take a few seconds).
CHILD_GRACE_S = 60.0
# Settings of the lab's own run loop that ``migrate --domain`` has no use for.
LAB_ONLY_SETS = ("warmup", "settle")
OTHER = {"src": "dst", "dst": "src"}


class LibvirtShuttle:
    """The domain, its images and the testbed's daemons for the length of a soak."""

    def __init__(self, cfg: ShuttleConfig, prefix: str = "l") -> None:
        self.cfg = cfg
        self.id = prefix + uuid.uuid4().hex[:7]
        self.name = f"livemig-soak-{self.id}"
        self.dir = paths.run_root() / self.id  # the hops' reports
        self.interrupted = False
        self.running: str | None = None  # the host the domain runs on
        self.agent: AgentLink | None = None  # its agent there
        self.boot: Workload = parse_workload(cfg.workload)
        self.workload: Workload = self.boot
        self._proc: asyncio.subprocess.Process | None = None
        self._say: Callable[[str], None] = lambda line: None

    def interrupt(self) -> None:
        """Ctrl-C: abort the hop under way (the child's own abort: the source runs on)
        and start no other."""
        self.interrupted = True
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGINT)

    @contextlib.asynccontextmanager
    async def session(self, say: Callable[[str], None],
                      image_size: int = 0) -> AsyncIterator[LibvirtShuttle]:
        """The testbed with both daemons (started if down), the domain's image; the
        domain removed at the end, or left running after Ctrl-C."""
        self._say = say
        if not topology.is_up():
            say("creating the testbed hosts (network namespaces) and their libvirt daemons")
        with libvirt_lab.testbed(parse_link_rate(topology.DEFAULT_LINK),
                                 f"soak {self.id}") as held:
            private.make_dir(self.dir)
            self._make_image(image_size)
            try:
                yield self
            finally:
                if self.interrupted and self.running is not None:
                    held.keep = True
                    say(f"interrupted: the domain {self.name} runs on {self.running} "
                        f"({libvirtd.uri(self.running)}); the testbed and its daemons are "
                        f"left up (livemig testbed down removes them all); the hops' "
                        f"reports are in {self.dir}")
                    await self._close_agent()
                else:
                    await self.stop_guest()

    def _image(self, side: str) -> Path:
        return libvirtd.image_path(side, f"{self.name}.img")

    def _make_image(self, image_size: int) -> None:
        w = self.boot
        size = max(MIN_IMAGE, image_size, *(d.size or 0 for d in w.disk),
                   w.verify.disk if w.verify else 0)
        with open(self._image("src"), "wb") as f:
            f.truncate(size)

    async def set_load(self, text: str) -> None:
        """Change the running guest's load (the agent restarts its workload, checker too)."""
        if self.agent is None:
            raise VMError("no guest runs yet: its first load is the boot load")
        spec = parse_workload(text)
        await change_load(self.agent, spec)
        self.workload = spec

    async def _boot(self) -> None:
        """Define and start the domain on src; wait for its agent's "ready"."""
        from livemig.virt.domain import lab_domain_xml

        xml = lab_domain_xml(self.name, self.cfg.qemu, paths.guest_kernel(),
                             paths.guest_initrd(), f"{libvirtd.IMAGES_DIR}/{self.name}.img",
                             memory_mib=-(-self.cfg.memory // MiB), workload=self.boot.text)

        def start() -> str:
            c = libvirt_lab.conn("src")
            try:
                dom = c.defineXML(xml)
                dom.create()
                return libvirt_lab.channel_path(dom.XMLDesc(0))
            finally:
                c.close()

        path = await asyncio.to_thread(start)
        self.running = "src"
        self.agent = await libvirt_lab.connect_agent("src", path, BOOT_TIMEOUT_S)
        try:
            await asyncio.wait_for(self.agent.ready.wait(), BOOT_TIMEOUT_S)
        except TimeoutError:
            raise VMError(f"{self.name}: the guest agent never said ready") from None
        self.workload = self.boot

    async def hop(self, index: int, name: str, c: Combination,
                  fault: Fault | None = None) -> Hop:
        """Migrate the domain to the other host with combination ``c``; verify; tally."""
        if fault is not None:
            raise VMError("libvirt hops carry no injected fault (a lab hook)")
        t_start = time.monotonic()
        if self.running is None:
            await self._boot()
        assert self.running is not None and self.agent is not None
        src, dst = self.running, OTHER[self.running]
        hop = Hop(index, name, src, dst, checker=self.workload.verify is not None)
        await asyncio.to_thread(self._place_disk, c.storage, src, dst)
        await asyncio.to_thread(topology.set_link, c.link)
        await asyncio.sleep(self.cfg.warmup)  # heartbeats before: the pause's baseline
        if self.interrupted:  # Ctrl-C before the migration began: nothing to write
            hop.report = {"outcome": "aborted", "reason": "interrupted"}
            return hop
        hop.t0 = time.time()
        agents = [self.agent]
        rep = await self._migrate(index, c, src, dst, agents)
        t_end = time.time()
        await asyncio.sleep(self.cfg.settle)  # the checker's first reads after the hop
        here = await asyncio.to_thread(libvirt_lab.where, self.name)
        self.running = next((s for s, st in here.items() if st == "running"), None)
        kept = {a.name: a for a in agents}.get(self.running or "")
        errors = [e for a in agents for e in a.verify_errors if e["t"] >= hop.t0]
        for a in agents:
            if a is not kept:
                await a.close()
        self.agent = kept
        if self.running is not None and self.agent is None:  # the follow came too late
            self.agent = await self._agent_on(self.running)
        rep.update(libvirt_lab.guest_pause(agents, rep, hop.t0, t_end))
        if self.running is None:
            rep.setdefault("where", here)  # paused after a disk mismatch, or gone
        hop.report = rep
        hop.guest_lost = self.running is None or (self.agent is None)
        tally(hop, errors)
        hop.wall_s = time.monotonic() - t_start
        return hop

    def _place_disk(self, storage: str, src: str, dst: str) -> None:
        """The destination's name for the disk: gone before a copied hop (libvirt
        pre-creates it), the source's image itself (a hard link) before a shared one."""
        there = self._image(dst)
        with contextlib.suppress(FileNotFoundError):
            there.unlink()
        if storage == "shared":
            os.link(self._image(src), there)
        _refresh_pool(dst)  # its volume list must match: a stale entry skips pre-creation

    async def _migrate(self, index: int, c: Combination, src: str, dst: str,
                       agents: list[AgentLink]) -> dict[str, Any]:
        """The child ``livemig migrate --domain``; its report (or why there is none)."""
        report = self.dir / f"hop-{index}.json"
        with contextlib.suppress(FileNotFoundError):
            report.unlink()
        sets = {k: v for k, v in c.sets.items() if k not in LAB_ONLY_SETS}
        argv = libvirt_lab.migrate_argv(self.name, report, src=src, dst=dst,
                                        profile=c.profile, sets=sets,
                                        bandwidth=c.bandwidth, storage=c.storage,
                                        max_time=self.cfg.max_time)
        self._proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)  # Ctrl-C reaches it once, through interrupt()
        if self.interrupted:  # Ctrl-C while it started
            self.interrupt()
        follow = asyncio.create_task(
            libvirt_lab.follow_to(dst, self.name, BOOT_TIMEOUT_S, agents.append))
        try:
            _, err = await asyncio.wait_for(self._proc.communicate(),
                                            self.cfg.max_time + CHILD_GRACE_S)
        except TimeoutError:
            self._proc.kill()
            _, err = await self._proc.communicate()
        finally:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        code = self._proc.returncode
        self._proc = None
        try:
            rep: dict[str, Any] = json.loads(report.read_text())
        except (OSError, ValueError):
            tail = err.decode(errors="replace").strip().splitlines()
            return {"outcome": "failed",
                    "reason": f"livemig migrate --domain wrote no report (exit {code}): "
                              f"{tail[-1] if tail else 'no output'}",
                    "consistency": {}}
        rep["child_exit"] = code
        return rep

    async def _agent_on(self, side: str) -> AgentLink | None:
        """The agent of the domain running on ``side`` (None: its channel is not there)."""
        def path() -> str:
            c = libvirt_lab.conn(side)
            try:
                return libvirt_lab.channel_path(c.lookupByName(self.name).XMLDesc(0))
            finally:
                c.close()
        try:
            return await libvirt_lab.connect_agent(side, await asyncio.to_thread(path), 10.0)
        except Exception as e:  # libvirt's own error class, or the channel's VMError
            self._say(f"no agent channel on {side}: {e}")
            return None

    async def _close_agent(self) -> None:
        if self.agent is not None:
            await self.agent.close()
            self.agent = None

    async def stop_guest(self) -> None:
        """Destroy and undefine the domain livemig defined; remove its images."""
        await self._close_agent()
        await asyncio.to_thread(libvirt_lab.remove_domain, self.name)
        self.running = None
        for side in libvirtd.SIDES:
            with contextlib.suppress(FileNotFoundError):
                self._image(side).unlink()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(_refresh_pool, side)
        for f in self.dir.glob("hop-*.json"):
            f.unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def _refresh_pool(side: str) -> None:
    """Have ``side``'s images pool re-read its directory."""
    c = libvirt_lab.conn(side)
    try:
        c.storagePoolLookupByName(libvirtd.POOL_NAME).refresh(0)
    finally:
        c.close()


def tally(hop: Hop, guest: list[dict[str, Any]]) -> None:
    """A libvirt hop's verdicts: with no fault to explain anything, every mismatch the
    host named (RAM or disk) and every checker report is unexplained; the checker's
    verdict is ok when it ran and reported nothing."""
    cons = hop.report.setdefault("consistency", {})
    hop.guest_errors = len(guest)
    if hop.checker and not guest and hop.report.get("outcome") == "completed":
        cons["guest"] = "ok"
    hop.unexplained = (int(cons.get("ram") == "mismatch") + int(cons.get("disk") == "mismatch")
                       + len(guest))

