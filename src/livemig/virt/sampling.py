"""The encoding choice for a libvirt domain: the engine's second plan
(:func:`livemig.engine.adapt.adapt`) through the domain.

The domain's QEMU is reached through libvirt's monitor passthrough
(:class:`DomainEnd`); pages through the patched QEMU's own sampler, or else, when the
QEMU runs on this host (:func:`local_pid`), its own mapping through ``/proc/PID/mem``,
or else libvirt's ``virDomainMemoryPeek`` (``VIR_MEMORY_PHYSICAL``, 64 KiB per call),
which libvirt serves on the QEMU's host: nothing is assumed about that host's files.
The source host's CPUs and free memory come from libvirt too. A sample taken moments
before by ``livemig evacuate`` (named in ``LIVEMIG_PAGE_SAMPLE``,
:mod:`livemig.sampling.given`) is used instead of a new one when it is this domain's
and fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

from livemig.engine.adapt import STOCK_CODECS, Adapted, Hints, adapt
from livemig.engine.events import EventStream
from livemig.engine.plan import Plan
from livemig.idlecpu import Counters, IdleMeter, Reader
from livemig.policy import encoding
from livemig.sampling import given
from livemig.sampling.readers import status_field
from livemig.virt import qmp
from livemig.virt.conn import LibvirtError, libvirt_module, message

HMP_FLAG = 1  # VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP


class DomainEnd:
    """The domain's QEMU as the engine's :class:`QmpEnd` (what ``adapt`` needs)."""

    def __init__(self, dom: Any) -> None:
        self.dom = dom
        self.name = f"domain {dom.name()}"

    async def cmd(self, command: str, **args: Any) -> Any:
        return await asyncio.to_thread(qmp.command, self.dom, command, **args)

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        await asyncio.sleep(timeout)
        return None

    async def has_command(self, command: str) -> bool:
        cmds = await self.cmd("query-commands")
        return any(c["name"] == command for c in cmds)

    def alive(self) -> bool:
        return bool(self.dom.isActive())

    @property
    def ram_file(self) -> None:
        return None

    @property
    def pid(self) -> None:
        return None  # the QEMU may run on another host


def peek_reader(dom: Any) -> Any:
    libvirt = libvirt_module()

    async def read(gpa: int, size: int) -> bytes:
        def peek() -> bytes:
            try:
                return bytes(dom.memoryPeek(gpa, size, libvirt.VIR_MEMORY_PHYSICAL))
            except libvirt.libvirtError as e:
                raise LibvirtError(f"memoryPeek at {gpa:#x}: {message(e)}") from None
        return await asyncio.to_thread(peek)
    return read


def local_threads(dom: Any) -> tuple[int, list[int]] | None:
    """The domain's QEMU process and its vCPU threads, when it runs on this host
    (this kernel: a daemon in another network or UTS namespace, as the testbed's,
    counts); else None.

    The vCPU thread ids QEMU reports (``query-cpus-fast``) are looked up in this
    host's ``/proc``, and the process found counts only if every vCPU thread is one
    of its threads and its command line carries the domain's UUID (libvirt passes
    ``-uuid``): a thread id from another host names no process that passes both but,
    by a one-in-millions chance, this domain's own incoming QEMU here, whose pages a
    sample would then read (a worse encoding, nothing changed in either guest)."""
    libvirt = libvirt_module()
    try:
        uuid = dom.UUIDString().encode()
        tids = [int(c["thread-id"]) for c in qmp.command(dom, "query-cpus-fast")]
    except (LibvirtError, libvirt.libvirtError, KeyError, TypeError, ValueError):
        return None  # a daemon or QEMU that will not say: libvirt's memory peek instead
    tgid = status_field(tids[0], "Tgid") if tids else None
    if not tgid:
        return None
    pid = int(tgid[0])
    with contextlib.suppress(OSError):
        if uuid in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") and all(
                Path(f"/proc/{pid}/task/{t}").exists() for t in tids):
            return pid, tids
    return None


def local_pid(dom: Any) -> int | None:
    """The domain's QEMU process when it runs on this host (:func:`local_threads`)."""
    found = local_threads(dom)
    return found[0] if found is not None else None


def node_counters(conn: Any) -> Reader:
    """A reader of the host's CPU counters (``virNodeGetCPUStats`` of all CPUs: idle
    and iowait against kernel and user; the CPU count asked once)."""
    libvirt = libvirt_module()
    cpus: list[int] = []

    def read() -> Counters | None:
        try:
            s = conn.getCPUStats(libvirt.VIR_NODE_CPU_STATS_ALL_CPUS)
            if not cpus:
                cpus.append(int(conn.getInfo()[2]))
        except (libvirt.libvirtError, AttributeError):  # a daemon that will not say
            return None
        idle = float(s.get("idle", 0) + s.get("iowait", 0))
        return idle, idle + float(s.get("kernel", 0) + s.get("user", 0)), cpus[0]
    return read


def node_meter(conn: Any) -> IdleMeter:
    """The host's idle CPUs (:func:`node_counters`), its first reading now."""
    return IdleMeter(node_counters(conn))


def host_hints(conn: Any, dom: Any, tls: bool = False,
               idle: IdleMeter | None = None, dst_local: bool = False,
               at_once: int = 1) -> Hints:
    """The source host's CPUs beside the domain's vCPUs, its idle CPUs (``idle``, a
    meter started earlier; None: not read) and its free memory; ``tls``: the stream
    goes over TLS (``VIR_MIGRATE_TLS``), which the model charges per byte. The free
    memory is this migration's share when an evacuation runs ``at_once`` of them
    (:data:`~livemig.virt.plan.MIGRATIONS_AT_ONCE_ENV`): the delta caches of all of
    them are sized from it."""
    cpus = int(conn.getInfo()[2])
    vcpus = int(dom.info()[3])
    return Hints(cpus=encoding.migration_cpus(vcpus, cpus, dst_local), dst_local=dst_local,
                 host_available=int(conn.getFreeMemory()) // max(1, at_once),
                 peek=peek_reader(dom), tls=tls,
                 idle=idle, local_pid=lambda: local_pid(dom), qemu_cap=False)


def given_sample(name: str, events: EventStream) -> given.GivenSampler | None:
    """The sample ``LIVEMIG_PAGE_SAMPLE`` names, if it is ``name``'s and fresh (else
    None, and an event says why it was not used)."""
    path = os.environ.get(given.ENV)
    if not path:
        return None
    result, why = given.load(Path(path), name)
    if result is None:
        events.event("page sample not reused", why=why)
        return None
    events.event("page sample reused", file=path, age_s=result.detail.get("age_s"),
                 sampler=result.sampler)
    return given.GivenSampler(result)


def adapt_domain(dom: Any, conn: Any, plan: Plan, events: EventStream,
                 tls: bool = False, idle: IdleMeter | None = None,
                 peer: str | None = None, dst_local: bool = False,
                 stock_peer: bool = False, at_once: int = 1) -> Adapted:
    """The second plan for ``dom`` (sync: libvirt runs are); ``idle``: the source
    host's idle-CPU meter, started when the run connected (else now); ``peer``: the
    destination host (the link's rate is read from the route to it); ``dst_local``:
    its daemon runs on this host; ``stock_peer``: the destination's QEMU lacks the
    patched build (stock's codecs, no codec switch, no delta cache); ``at_once``: the
    migrations an evacuation runs at once from this host (:func:`host_hints`)."""
    auto = (plan.livemig_setting("encoding") == "auto"
            and plan.livemig_setting("sampler") == "auto")
    reuse = given_sample(str(dom.name()), events) if auto else None  # else unused
    # the destination QEMU libvirt starts gets x-multifd-compression-switch by -global
    # (virt/plan.py) when the source has it: the same build at both ends unless a
    # first attempt found otherwise (virt/run.py: refused_global)
    hints = dataclasses.replace(
        host_hints(conn, dom, tls, idle if idle is not None else node_meter(conn),
                   dst_local, at_once),
        peer=peer, given=reuse, dst_switch=not stock_peer,
        dst_codecs=STOCK_CODECS if stock_peer else None,
        dst_delta=False if stock_peer else None)
    return asyncio.run(adapt(DomainEnd(dom), plan, hints, events))
