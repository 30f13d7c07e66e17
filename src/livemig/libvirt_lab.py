"""The lab's guest as a libvirt domain on the testbed's two daemons.

What ``livemig bench --via libvirt`` and ``livemig soak --path libvirt`` share: a
connection to a host's daemon, the agent's virtio-serial channel (the socket libvirt
names on each host, read from the root namespace), the child-process ``livemig
migrate --domain`` call, following the guest's agent onto the destination while the
migration runs, the guest-visible pause from the agent's heartbeats, removing the
domain, and the testbed with its daemons up.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig import metrics
from livemig.errors import SetupError, VMError
from livemig.lab.agent import AgentLink
from livemig.testbed import libvirtd, topology

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 0.1  # how often the destination is asked for the incoming domain


def conn(side: str) -> Any:
    """A connection to ``side``'s daemon over its UNIX socket (from the root namespace)."""
    from livemig.virt.conn import libvirt_module

    return libvirt_module().open(libvirtd.local_uri(side))


def channel_path(xml: str) -> str:
    """The agent channel's socket in a live domain XML (libvirt names it)."""
    root = ET.fromstring(xml)
    for ch in root.iterfind("./devices/channel"):
        target = ch.find("target")
        src = ch.find("source")
        if target is not None and target.get("name", "").startswith("org.livemig.agent") \
                and src is not None and src.get("path"):
            return str(src.get("path"))
    raise VMError("the domain has no livemig agent channel")


async def connect_agent(side: str, path: str, timeout: float) -> AgentLink:
    """The agent on ``side`` through the channel socket its daemon named ``path``."""
    a = AgentLink(side, libvirtd.host_view(side, path))
    await a.connect(timeout)
    return a


def migrate_argv(name: str, report: Path, *, src: str = "src", dst: str = "dst",
                 profile: str = "defaults", sets: dict[str, str] | None = None,
                 bandwidth: int | None = None, storage: str = "shared",
                 max_time: float = 300.0) -> list[str]:
    """``livemig migrate --domain NAME`` from ``src``'s daemon to ``dst``'s, as a user
    runs it (a child process, quiet, its report in ``report``)."""
    argv = [sys.executable, "-m", "livemig.cli", "migrate", "--domain", name,
            "--connect", libvirtd.uri(src), "--to", libvirtd.uri(dst),
            "--profile", profile, "--storage", storage, "--report", str(report), "-q",
            "--max-time", f"{max_time:g}"]
    if storage == "shared":
        # the testbed's shared storage is one file system both daemons see; libvirt
        # cannot tell it is shared (it is not NFS or a cluster FS)
        argv.append("--unsafe")
    if bandwidth:
        argv += ["--bandwidth", str(bandwidth)]
    for k, v in (sets or {}).items():
        argv += ["--set", f"{k}={v}"]
    return argv


async def follow_to(side: str, name: str, timeout: float,
                    found: Callable[[AgentLink], None]) -> None:
    """Connect to the agent's channel on ``side`` as soon as libvirt has started the
    incoming QEMU there (its socket is there from the prepare phase), so that the
    guest's first heartbeats after the switchover are seen when they come; ``found``
    gets the link. Runs until it connects or is cancelled."""
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    c = await asyncio.to_thread(conn, side)
    try:
        while True:
            try:
                dom = await asyncio.to_thread(c.lookupByName, name)
                path = channel_path(await asyncio.to_thread(dom.XMLDesc, 0))
                found(await connect_agent(side, path, timeout))
                return
            except (libvirt.libvirtError, VMError):
                await asyncio.sleep(FOLLOW_POLL_S)
    finally:
        c.close()


def hold_window(rep: dict[str, Any], t_end: float) -> tuple[float, float] | None:
    """When the destination was held paused for the disk comparison (the lab's verify
    hold), in host time: it ended at the report's event "destination resumed"."""
    detail = rep.get("consistency", {}).get("disk_detail") or {}
    hold = detail.get("hold_s")
    t0 = rep.get("started_at")
    resumed = [e["t"] for e in rep.get("events", []) if e.get("event") == "destination resumed"]
    if hold is None or not resumed or t0 is None:
        return None
    start = datetime.datetime.fromisoformat(t0).timestamp()
    end = start + float(resumed[-1])
    return (end - float(hold), min(end, t_end))


def guest_pause(agents: list[AgentLink], rep: dict[str, Any], t_migrate: float,
                t_end: float) -> dict[str, Any]:
    """The longest gap in the agent's heartbeats (both hosts' channels) between the
    migration's start and a second after its end, less the disk comparison's hold."""
    beats = sorted(b for a in agents for b in a.heartbeats)
    gap = metrics.longest_gap(beats, t_migrate, t_end + 1.0)
    if gap is None:
        return {"guest_pause_ms": None}
    pause = gap.seconds
    hold = hold_window(rep, t_end)
    if hold is not None and gap.start <= hold[0] <= gap.end:
        pause = max(pause - (hold[1] - hold[0]), 0.0)
    return {"guest_pause_ms": round(pause * 1000.0, 1),
            "guest_pause_raw_ms": round(gap.seconds * 1000.0, 1)}


def where(name: str) -> dict[str, str]:
    """The hosts that have the domain, and its state there (running, paused, shut off)."""
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    states = {libvirt.VIR_DOMAIN_RUNNING: "running", libvirt.VIR_DOMAIN_PAUSED: "paused"}
    out = {}
    for side in libvirtd.SIDES:
        c = conn(side)
        try:
            dom = c.lookupByName(name)
            out[side] = states.get(dom.state()[0], "shut off") if dom.isActive() \
                else "shut off"
        except libvirt.libvirtError:
            continue
        finally:
            c.close()
    return out


def remove_domain(name: str) -> None:
    """Destroy and undefine livemig's own domain ``name`` wherever it is."""
    for side in libvirtd.SIDES:
        try:
            c = conn(side)
        except Exception as e:  # libvirt's own error class; nothing to clean there
            log.info("cleanup %s: %s", side, e)
            continue
        try:
            for d in c.listAllDomains():
                if d.name() == name:
                    with contextlib.suppress(Exception):
                        if d.isActive():
                            d.destroy()
                    with contextlib.suppress(Exception):
                        if d.isPersistent():
                            d.undefine()
        finally:
            c.close()


def warm(emulators: list[Path]) -> None:
    """Every running daemon of the testbed knows ``emulators``' capabilities before the
    caller's clock starts, as a fleet host's daemon does from its first start of them:
    probed here once when the cache the testbed keeps across restarts did not have
    them (libvirtd.save_caps, at ``down``), read from it after. A migration into a
    daemon that never saw its emulator pays the probe inside the call (~4.5 s under
    TCG)."""
    for side in libvirtd.ALL_SIDES:
        if not libvirtd.is_running(side):
            continue
        c = conn(side)
        try:
            for emu in emulators:
                if emu.exists():
                    c.getDomainCapabilities(str(emu), "x86_64", "q35", "qemu", 0)
        finally:
            c.close()


@dataclass
class Held:
    """The testbed a ``testbed()`` block holds; ``keep``: leave up what it started
    (a domain left running on it, say after Ctrl-C)."""

    created: bool
    started: list[str]
    keep: bool = False


@contextlib.contextmanager
def testbed(link: int | None, owner: str) -> Iterator[Held]:
    """The testbed with its libvirt daemons, the link shaped to ``link`` bits/s (None:
    unshaped); held (the testbed lock) for the block. What this started is stopped
    after, unless the block set ``keep``."""
    with topology.locked():
        created = not topology.is_up()
        if created:
            topology.up(link, owner=owner)
        else:
            topology.set_link(link)
        started = [s for s in libvirtd.SIDES if not libvirtd.is_running(s)]
        try:
            libvirtd.up()
        except SetupError:
            if created:
                topology.down(quiet=True)
            raise
        held = Held(created, started)
        try:
            yield held
        finally:
            if not held.keep:
                if started:
                    libvirtd.down()
                if created:
                    topology.down(quiet=True)
