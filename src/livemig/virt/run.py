"""One migration of a libvirt domain, driven through libvirt's API.

Phases (one method each): ``prepare`` (connections, domain, what its QEMU offers,
the engine's second plan, the source-side passthrough settings, remembered for
restoring) → ``migrate`` (``virDomainMigrateToURI3``, peer-to-peer, in a thread of
its own, watched by the engine's monitor through :mod:`livemig.virt.job`: the same
loop, policy executor (with the libvirt actuator, ``virt/actuator.py``), limits and
stall watchdog as lab and attach runs; each of them aborts libvirt's job) →
``finish`` (on success: completed statistics from the destination, the disk
comparison while the destination is held paused, then resume it; otherwise: the
source keeps running and everything livemig changed on it is restored).

livemig never stops or kills the domain: libvirt does the switchover, and on any
failure or abort libvirt resumes the source; livemig only undoes its own settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from livemig.engine.adapt import Deferred
from livemig.engine.events import EventStream, progress_listener
from livemig.engine.executor import SWITCHOVER_BW, PolicyConfig, PolicyExecutor
from livemig.engine.linkprobe import peer_of
from livemig.engine.monitor import Monitor, Terminal
from livemig.engine.observe import Observation
from livemig.engine.plan import Plan as EnginePlan
from livemig.engine.second_look import Beside
from livemig.errors import LivemigError, UsageError, VMError
from livemig.idlecpu import IdleMeter
from livemig.progress import Progress
from livemig.virt import hold, journal, qmp
from livemig.virt.actuator import IoDevice, LibvirtActuator, io_devices
from livemig.virt.conn import (
    LibvirtError,
    find,
    libvirt_module,
    lookup,
    message,
    on_this_host,
    open_uri,
)
from livemig.virt.facts import (
    DiskEnds,
    NbdEnds,
    compare_copied_disks,
    cpu_seconds,
    disk_aliases,
    disk_formats,
    emulator,
    host_uuid,
    on_one_machine,
    same_file_on_both,
    version,
    writable_disks,
)
from livemig.virt.job import DomainJob
from livemig.virt.plan import (
    LIBVIRT_RESET_CAPS,
    LIBVIRT_RESET_PARAMS,
    PAUSED,
    POSTCOPY,
    RAM_CHECK_CAP,
    STREAM_PARAMS,
    Plan,
    QemuInfo,
    Request,
    disk_check_fallback,
    disk_check_method,
    has_stream_globals,
    make_plan,
    refused_global,
    with_globals,
)
from livemig.virt.repair import put_back
from livemig.virt.sampling import DomainEnd, adapt_domain, node_meter
from livemig.virt.stats import PREPARE, disk_observation, disk_sample
from livemig.virt.vcpus import vcpu_share

log = logging.getLogger(__name__)

VIRT_ONLY = ("disk-check",)  # settings of libvirt runs that the engine's plan refuses
RAM_CHECK_METHOD = f"in-stream digest ({RAM_CHECK_CAP})"
T = TypeVar("T")


@dataclass(frozen=True)
class DomainOptions:
    domain: str
    src_uri: str
    dst_uri: str
    profile: str
    wanted: dict[str, str]
    explicit: frozenset[str]
    request: Request
    max_time: float | None = None
    disk_fault: int | None = None  # debug: flip this byte of the destination's image
    # the destination's QEMU lacks the patched build's stream mechanisms: a first
    # attempt's destination refused one at its start (refused_global), or the caller
    # knew it before (``stock_told``: how, from STOCK_PEER_ENV)
    stock_peer: bool = False
    stock_told: str = ""
    stock_found: str | None = None  # a file to write the refused property to (STOCK_FOUND_ENV)
    # migrations an evacuation runs at once from the source (MIGRATIONS_AT_ONCE_ENV)
    at_once: int = 1


@dataclass
class Outcome:
    outcome: str = "failed"  # completed | aborted | failed
    reason: str | None = None


# query-migrate states in which total-time counts from QEMU's ``migrate`` command
ACTIVE_STATES = ("setup", "active", "pre-switchover", "device", "postcopy-active")


@dataclass
class DomainRun:
    """What one run observed as it went; ``record.freeze`` makes it the engine's
    immutable ``MigrationRecord`` (and ``LibvirtFacts``) once it has ended."""

    opts: DomainOptions
    t0: float = field(default_factory=time.time)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    t_migrate: float | None = None
    t_end: float | None = None  # virDomainMigrateToURI3 returned
    # QEMU's own migration began (its ``migrate``, after libvirt's begin/prepare: the
    # destination QEMU started, and the disk copy): anchored from a passthrough
    # ``query-migrate``'s ``total-time`` at the first poll that sees it active
    t_qemu: float | None = None
    # the source was paused for a pre-copy switchover (libvirt's lifecycle event,
    # suspended for migration): QEMU's migration ends its downtime later
    t_switch: float | None = None
    t_cont: float | None = None  # the held-paused destination was resumed
    result: Outcome = field(default_factory=Outcome)
    plan: Plan | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    completed_stats: dict[str, Any] = field(default_factory=dict)
    cpu: dict[str, float | None] = field(default_factory=dict)
    ram_check: dict[str, Any] = field(default_factory=dict)
    disk_check: dict[str, Any] = field(default_factory=dict)
    source_after: dict[str, Any] | None = None
    destination: dict[str, Any] = field(default_factory=dict)
    libvirt: dict[str, Any] = field(default_factory=dict)
    encoding: dict[str, Any] | None = None  # the engine's choice (virt.sampling)
    engine_plan: EnginePlan | None = None  # the engine's second plan (virt.sampling)

    def event(self, what: str, **data: Any) -> None:
        self.events.append({"t": round(time.time() - self.t0, 3), "event": what, **data})


class DomainMigration:
    def __init__(self, opts: DomainOptions, progress: Progress) -> None:
        self.opts = opts
        self.progress = progress
        self.run = DomainRun(opts)
        self.libvirt = libvirt_module()
        self.src_conn: Any = None
        self.dst_conn: Any = None
        self.dom: Any = None
        self.idle: IdleMeter | None = None  # the source host's idle CPUs (prepare on)
        self.disks: dict[str, str] = {}  # target -> source path (copied disks)
        self.disk_formats: dict[str, str] = {}  # target -> raw, qcow2, ...
        self.disk_method = "nbd"  # nbd | file | stream: how the copied disks are compared
        self.domain_xml = ""  # the source domain's live XML (the NBD reader's template)
        self.restore_params: dict[str, Any] = {}
        self.restore_caps: dict[str, bool] = {}
        self.orig_downtime: int | None = None
        self.downtime_changed = False
        self.executor: PolicyExecutor | None = None
        self.actuator: LibvirtActuator | None = None
        self.disk_written: dict[str, tuple[float, int]] = {}  # target -> (t, wr_bytes)
        # puts back what this run set, and resumes a held destination, if we die
        self.guard: hold.Guard | None = None
        self.journaled: dict[str, Any] = {}  # what the journal says (virt/journal.py)
        self._aio: asyncio.Runner | None = None  # runs the executor's coroutines
        self.stop_reason: str | None = None
        # Ctrl-C / SIGTERM: keeps the call from being made, else the monitor's limit
        self._interrupt = asyncio.Event()
        self._job: DomainJob | None = None
        self._downtime_set = False
        self._disk_obs: dict[str, Any] | None = None  # this poll's, for the policies
        self._cpu0: float | None = None
        self._cpu_last: float | None = None
        self._mig_conn: Any = None
        self._event_ids: list[int] = []
        self._interruptible = False  # a signal now stops the disk comparison
        # the encoding chosen beside the first pass (engine.adapt: both ends switch)
        self.deferred: Deferred | None = None
        self.qemu: QemuInfo | None = None  # the source QEMU as probed in prepare

    # -- phase 1 ------------------------------------------------------------------------
    def prepare(self) -> None:
        o = self.opts
        self.src_conn = open_uri(o.src_uri, "--connect")
        self.dom = lookup(self.src_conn, o.domain, o.src_uri)
        if not self.dom.isActive():
            raise UsageError(f"domain {o.domain!r} is not running on {o.src_uri} "
                             "(livemig migrates running domains)")
        # the encoding model reads the source host's idle CPUs over what follows
        self.idle = node_meter(self.src_conn)
        self.dst_conn = open_uri(o.dst_uri, "--to")
        src_host = host_uuid(self.src_conn)
        if src_host is not None and src_host == host_uuid(self.dst_conn):
            raise UsageError("--connect and --to reach the same libvirt host (same host "
                             "UUID)")
        other = find(self.dst_conn, o.domain)
        if other is not None and other.isActive():
            raise UsageError(f"domain {o.domain!r} already runs on {o.dst_uri}")
        self._repair_leftovers()  # first: what is probed next is then the real state
        xml = self.dom.XMLDesc(0)
        self.domain_xml = xml
        self.disks = writable_disks(xml)
        self.disk_formats = disk_formats(xml)
        info = self.qemu = qmp.probe(self.dom)
        req = o.request
        if req.storage == "copy":
            req = Request(**{**req.__dict__, "disks": tuple(self.disks)})
        peer = info  # what the plan may use: what the destination's QEMU can take
        if o.stock_peer and info.peer_mechanisms:
            peer = info.for_stock_peer()
            if o.stock_told:
                self.run.event("stock destination", how=o.stock_told)
                self.progress.step(f"the destination's QEMU is not the patched build "
                                   f"({o.stock_told}): what a stock QEMU has")
        plan = make_plan(self._second_plan(), o.explicit, peer, req)
        if req.storage == "copy":
            if not self.disks:
                raise UsageError(f"--storage copy: domain {o.domain!r} has no writable disk")
            shared = same_file_on_both(o.src_uri, o.dst_uri, list(self.disks.values()))
            if shared:
                raise UsageError(f"--storage copy: both hosts see {shared} as the same "
                                 "file (shared storage: use --storage shared)")
            self.disk_method = disk_check_method(plan.disk_check,
                                                 on_one_machine(o.src_uri, o.dst_uri))
        self.run.plan = plan
        self.run.libvirt = {
            "library_version": version(self.libvirt.getVersion()),
            "source_daemon": version(self.src_conn.getLibVersion()),
            "destination_daemon": version(self.dst_conn.getLibVersion()),
            "emulator": emulator(xml),
            "source_host": self.src_conn.getHostname(),
            "destination_host": self.dst_conn.getHostname(),
        }
        self.run.ram_check = ({"result": "pending", "method": RAM_CHECK_METHOD}
                              if plan.ram_check else
                              {"result": "skipped", "why": plan.ram_check_why})
        for note in plan.notes:
            self.run.event("not applied", note=note)
            self.progress.step(note)
        self._apply_source_settings(plan, dict(info.parameters), info.capabilities)
        start = plan.downtime_ms or int(info.parameters.get("downtime-limit", 300))
        io = self._io_devices(xml) if plan.io_qos else ()
        self.actuator = LibvirtActuator(self.dom, lambda ex, **a: qmp.command(self.dom, ex, **a),
                                        self.libvirt.libvirtError, plan.throttle_knob, io)
        # libvirt drives the disk copy: no link share (disk-schedule), IO QoS if asked
        cfg = PolicyConfig(throttle=plan.throttle, downtime_ms=start,
                           downtime_ramp=plan.downtime_ramp, max_downtime=plan.max_downtime,
                           on_stall=plan.on_stall, postcopy_after=plan.postcopy_after,
                           switchover_bandwidth=plan.switchover_bandwidth,
                           ram_cap=o.request.bandwidth, disk_copy=bool(io), io_qos=bool(io))
        self.executor = PolicyExecutor(cfg, self.actuator,
                                       lambda what, data: self.run.event(what, **data))
        self.executor.after_first_pass(self.run.encoding)
        with contextlib.suppress(self.libvirt.libvirtError):
            self.orig_downtime = int(self.dom.migrateGetMaxDowntime(0))
        # what the policies may change during the migration, for the guard
        self.journaled.update(io=[d.qdev for d in io], downtime_ms=self.orig_downtime)
        journal.write(o.domain, **self.journaled)

    def _io_devices(self, xml: str) -> tuple[IoDevice, ...]:
        """The copied disks' devices the IO cap goes on (io-qos); what is left alone
        is said in the events."""
        blocks = qmp.command(self.dom, "query-block") or []
        found, why = io_devices(blocks, disk_aliases(xml), tuple(self.disks))
        for w in why:
            self.run.event("io-qos not applied", disk=w)
            self.progress.step(f"io-qos not applied: {w}")
        if found:
            self.run.event("io-qos", disks={d.target: d.qdev for d in found})
        return tuple(found)

    def _await(self, coro: Awaitable[T]) -> T:
        """Run one of the executor's coroutines from this synchronous run."""
        if self._aio is None:
            self._aio = asyncio.Runner()

        async def wrap() -> T:
            return await coro
        return self._aio.run(wrap())

    def _second_plan(self) -> dict[str, str]:
        """The engine's second plan for this domain (:mod:`livemig.virt.sampling`): the
        stream encoding from a sample of the guest's pages (the patched QEMU's own
        sampler, else libvirt's memory peek) and the profile fitted to the domain's
        QEMU; returned as the wanted settings ``make_plan`` maps onto libvirt."""
        o = self.opts
        virt_only = {k: v for k, v in o.wanted.items() if k in VIRT_ONLY}
        first = EnginePlan(
            uri="", settings=tuple((k, v) for k, v in o.wanted.items() if k not in virt_only),
            explicit=o.explicit - set(virt_only), profile=o.profile,
            bandwidth=o.request.bandwidth).validate()
        events = EventStream(self.run.t0)
        events.subscribe(progress_listener(self.progress))
        adapted = adapt_domain(self.dom, self.src_conn, first, events, o.request.tls,
                               self.idle, peer_of(o.request.migrate_uri or o.dst_uri),
                               dst_local=on_this_host(o.dst_uri), stock_peer=o.stock_peer,
                               at_once=o.at_once)
        self.run.events.extend(events.log)
        self.run.encoding = adapted.encoding
        self.deferred = adapted.deferred
        self.run.engine_plan = adapted.plan
        wanted = {**adapted.plan.wanted, **virt_only}
        if adapted.encoding and adapted.encoding.get("encoding"):
            wanted["encoding"] = "off"  # chosen: the applied stream settings carry it
        return wanted

    def _repair_leftovers(self) -> None:
        """Undo what a dead livemig run (kill -9) left set on this domain's QEMU, on
        whichever end it runs now, unless a migration job still runs there."""
        o = self.opts
        j = journal.left_by_dead_run(o.domain)
        if j is None:
            return

        def dom_at(uri: str) -> Any:
            if uri == o.src_uri:
                return self.dom
            return find(self.dst_conn, o.domain) if uri == o.dst_uri else None
        repaired, waiting = put_back(j, dom_at, self.libvirt.VIR_DOMAIN_JOB_NONE)
        for uri in waiting:
            self.run.event("leftovers kept: a job still runs", uri=uri)
        if repaired:
            self.run.event("repaired a dead run's settings", ends=repaired)
            self.progress.step(f"restored what a dead livemig run left set on "
                               f"{o.domain}: {repaired}")
        journal.remove(o.domain)

    def _apply_source_settings(self, plan: Plan, current: dict[str, Any],
                               offered: frozenset[str]) -> None:
        caps: dict[str, bool] = {}
        if plan.src_caps:
            caps = qmp.current_capabilities(self.dom)
        self.restore_caps = {k: caps[k] for k in plan.src_caps if k in caps}
        self.restore_params = {k: current[k] for k in plan.src_qmp if k in current}
        if plan.switchover_bandwidth and SWITCHOVER_BW in current:  # set mid-run
            self.restore_params[SWITCHOVER_BW] = current[SWITCHOVER_BW]
        # from here on livemig may change the domain: should it die, its guard puts
        # back what the journal records (and resumes a destination held paused)
        self.guard = hold.start(self.opts.domain, self.opts.dst_uri, self.opts.src_uri,
                                paused=bool(plan.flags & PAUSED))
        if plan.drain:
            # libvirt's own reset fails while the drain is on (see plan): livemig puts
            # back what it would have, should the source keep running
            self.restore_caps.update({k: caps[k] for k in LIBVIRT_RESET_CAPS
                                      if k in offered and k in caps})
            self.restore_params.update({k: current[k] for k in LIBVIRT_RESET_PARAMS
                                        if k in current})
        self.journaled = {"src_uri": self.opts.src_uri, "dst_uri": self.opts.dst_uri,
                          "params": self.restore_params, "caps": self.restore_caps,
                          "dst_params": {k: current.get(k, "none") for k in plan.dst_globals
                                         if k in STREAM_PARAMS}}
        journal.write(self.opts.domain, **self.journaled)
        if plan.src_caps:
            qmp.command(self.dom, "migrate-set-capabilities", capabilities=[
                {"capability": k, "state": v} for k, v in plan.src_caps.items()])
        if plan.src_qmp:
            try:
                qmp.command(self.dom, "migrate-set-parameters", **plan.src_qmp)
            except LibvirtError as e:
                self._restore_source()
                raise UsageError(f"the domain's QEMU refused {plan.src_qmp}: {e}") from None
        if plan.src_qmp or plan.src_caps:
            self.run.event("source passthrough set", parameters=plan.src_qmp,
                           capabilities=plan.src_caps)

    # -- phase 2 ------------------------------------------------------------------------
    def migrate(self) -> None:
        """libvirt's call in a thread of its own (:class:`livemig.virt.job.DomainJob`),
        watched by the engine's monitor: one fixed-period loop that polls the job,
        ticks the policies (through the libvirt actuator), applies ``--max-time``,
        Ctrl-C and the stall watchdog, and aborts the job for any of them."""
        plan = self.run.plan
        assert plan is not None and self.executor is not None
        params = dict(plan.params)
        xml = self.dom.XMLDesc(self.libvirt.VIR_DOMAIN_XML_MIGRATABLE)
        if plan.dst_globals or has_stream_globals(xml):
            params[self.libvirt.VIR_MIGRATE_PARAM_DEST_XML] = with_globals(
                xml, plan.dst_globals)
        executor = self.executor
        # Ctrl-C / SIGTERM are livemig's from here on: before the call is made they
        # keep it from being made (the source's settings are then put back: finish),
        # after it they abort libvirt's job
        with self._signals():
            # the blocking call gets a connection of its own; polls and abort use the other
            mig_conn = open_uri(self.opts.src_uri, "--connect")
            mig_dom = lookup(mig_conn, self.opts.domain, self.opts.src_uri)
            self._mig_conn = mig_conn
            job = DomainJob(self.dom, self.libvirt,
                            lambda: mig_dom.migrateToURI3(self.opts.dst_uri, params, plan.flags),
                            lambda: executor.throttle_pct, self.run.event,
                            postcopy=bool(plan.flags & POSTCOPY),
                            qemu_migration=lambda: qmp.command(self.dom, "query-migrate"),
                            yank=lambda: qmp.command(self.dom, "yank",
                                                     instances=[{"type": "migration"}]))
            self._job = job
            self.progress.step(f"migrating {self.opts.domain}: {self.opts.src_uri} -> "
                               f"{self.opts.dst_uri} ({', '.join(plan.flag_names())})")
            shown = {k: (f"<domain XML + {plan.dst_globals}>" if k ==
                         self.libvirt.VIR_MIGRATE_PARAM_DEST_XML else v)
                     for k, v in params.items()}
            self.run.event("migration started", flags=plan.flag_names(), params=shown)
            self.run.t_migrate = time.time()
            self._watch_iterations(job)
            self._cpu0 = self._cpu_last = cpu_seconds(self.dom)
            # the destination may be held paused (VIR_MIGRATE_PAUSED): the guard,
            # started with the settings (prepare), resumes it should livemig die
            end: Terminal | None = None
            failed: str | None = None
            if not self._interrupt.is_set():
                job.start()
                events = EventStream(self.run.t0)
                events.log = self.run.events  # one list: the run's events
                events.subscribe(progress_listener(self.progress))
                vcpus, how = vcpu_share(self.src_conn, self.dom)
                self.run.event("vcpu share " + ("read" if vcpus else "not read"),
                               **{"from" if vcpus else "reason": how})
                monitor = Monitor(job, events, plan.poll_interval, self.run.t_migrate,
                                  self.opts.max_time, self._interrupt, executor,
                                  _Hooks(self, job), self.run.timeline,
                                  stall_timeout=plan.stall_timeout, release=executor.release,
                                  vcpus=vcpus)
                try:
                    end = self._await(self._watched(monitor, events))
                except VMError as e:  # the job did not end within the abort's time
                    failed = str(e)
        self.run.t_end = time.time()
        if self._cpu0 is not None and self._cpu_last is not None:
            self.run.cpu["source"] = round(self._cpu_last - self._cpu0, 3)
        if not job.started:  # interrupted before the call was made
            self.run.result = Outcome("aborted", self.stop_reason)
        elif failed is not None or end is None:
            self.run.result = Outcome("failed", f"libvirt did not end the migration: "
                                      f"{failed}")
        elif end.status == "completed":
            self.run.result = Outcome("completed")
        elif end.status == "cancelled":
            self.run.result = Outcome("aborted", self.stop_reason or end.cancelled_for)
        else:
            self.run.result = Outcome("failed", end.cancelled_for
                                      or str(end.info.get("error-desc") or "failed"))
        if self.run.result.outcome != "completed" and plan.ram_check:
            self.run.ram_check = ram_check_failed(self.run.result.reason or "")
        self.progress.close()

    async def _watched(self, monitor: Monitor, events: EventStream) -> Terminal:
        """The monitor's loop, with the deferred encoding choice beside it: sampled
        through the domain while the first pass runs, then switched to on the source
        (:func:`livemig.engine.switch.switch`), and looked at again once the first pass
        is over (:mod:`livemig.engine.second_look`); stopped if the migration ends
        first."""
        if self.deferred is None:
            return await monitor.run()
        assert self.qemu is not None  # probed in prepare
        beside = Beside.start(DomainEnd(self.dom), self.deferred, self.run.encoding or {},
                              self.qemu.parameters, events, self.executor)
        try:
            return await monitor.run()
        finally:
            self.run.encoding = await beside.outcome(self.run.encoding, events)

    def _watch_iterations(self, job: DomainJob) -> None:
        """QEMU's MIGRATION_PASS as libvirt's migration-iteration event: each round's
        start goes to ``events`` as it happens (the polls only see its effect), and
        to the job, which wakes the monitor when the first pass is over. The source's
        pause for the switchover (a lifecycle event) sets ``t_switch``: what follows
        QEMU's migration in the call (libvirt's finish and confirm) is told apart."""
        lv = self.libvirt

        def on_iteration(_conn: Any, _dom: Any, iteration: int, _opaque: Any) -> None:
            self.run.event("round", iteration=iteration)
            job.passed(iteration)

        def on_lifecycle(_conn: Any, _dom: Any, event: int, detail: int,
                         _opaque: Any) -> None:
            # a pre-copy switchover only: after a post-copy start (its own detail)
            # QEMU's migration goes on, so the call is not split there
            if (event == lv.VIR_DOMAIN_EVENT_SUSPENDED and self.run.t_switch is None
                    and detail == lv.VIR_DOMAIN_EVENT_SUSPENDED_MIGRATED):
                self.run.t_switch = time.time()
        for ev, cb in ((lv.VIR_DOMAIN_EVENT_ID_MIGRATION_ITERATION, on_iteration),
                       (lv.VIR_DOMAIN_EVENT_ID_LIFECYCLE, on_lifecycle)):
            try:
                self._event_ids.append(
                    self.src_conn.domainEventRegisterAny(self.dom, ev, cb, None))
            except lv.libvirtError as e:
                self.run.event("no iteration events" if cb is on_iteration
                               else "no lifecycle events", error=message(e))

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def handler(signum: int, _frame: object) -> None:
            self.stop_reason = f"interrupted ({signal.Signals(signum).name})"
            self._interrupt.set()  # nothing awaits it: a flag the monitor reads
            if self._interruptible:  # once: the comparison's cleanup runs undisturbed
                self._interruptible = False
                raise KeyboardInterrupt
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _on_poll(self, job: DomainJob, obs: Observation) -> dict[str, Any]:
        """The run's own work at each of the monitor's polls, once libvirt's job has
        figures: the downtime limit (libvirt takes it only once its job runs), the
        source's CPU, when QEMU's ``migrate`` ran, and the disks' figures for the
        policies and the timeline."""
        plan = self.run.plan
        assert plan is not None
        self._disk_obs = None
        if obs.status == PREPARE or obs.terminal:
            return {}
        if not self._downtime_set and plan.downtime_ms is not None:
            self._downtime_set = self._set_downtime(plan.downtime_ms, "--set downtime-limit")
        self._cpu_last = cpu_seconds(self.dom) or self._cpu_last
        if self.run.t_qemu is None:
            self._anchor_qemu_start()
        self._disk_obs = disk_observation(job.stats, self._disk_write_rate())
        return disk_sample(job.stats)

    def _anchor_qemu_start(self) -> None:
        """When QEMU's ``migrate`` ran, from its ``total-time`` (one passthrough query;
        a query job, which libvirt allows beside the migration)."""
        try:
            info = qmp.command(self.dom, "query-migrate") or {}
        except LivemigError:
            return
        total = info.get("total-time")
        if info.get("status") in ACTIVE_STATES and isinstance(total, (int, float)):
            self.run.t_qemu = time.time() - total / 1000.0
            self.run.event("qemu migration started", before_s=round(total / 1000.0, 3))

    def _disk_write_rate(self) -> float | None:
        """Bytes/s the guest writes to the copied disks since the last poll (the IO
        QoS policy's measure; libvirt's blockStats is a query, allowed beside the
        migration)."""
        if self.actuator is None or not self.actuator.io:
            return None
        now = time.monotonic()
        total = 0.0
        for dev in self.actuator.io:
            try:
                wr = int(self.dom.blockStats(dev.target)[3])
            except self.libvirt.libvirtError:
                return None
            before = self.disk_written.get(dev.target)
            self.disk_written[dev.target] = (now, wr)
            if before is None or now <= before[0]:
                return None
            total += (wr - before[1]) / (now - before[0])
        return total

    def _set_downtime(self, ms: int, why: str) -> bool:
        try:
            self.dom.migrateSetMaxDowntime(ms, 0)
        except self.libvirt.libvirtError as e:
            self.run.event("downtime not set", ms=ms, error=message(e))
            return False
        self.downtime_changed = True
        self.run.event("downtime limit", ms=ms, reason=why)
        return True

    def _release(self) -> None:
        """No throttle and no IO cap on a source that keeps running."""
        if self.executor is not None:
            self._await(self.executor.release())

    # -- phase 3 ------------------------------------------------------------------------
    def finish(self) -> None:
        try:
            if self.run.result.outcome == "completed":
                self._finish_completed()
            else:
                self._finish_source_kept()
        except (self.libvirt.libvirtError, LivemigError) as e:
            # the outcome stands (libvirt decided it); what could not be checked is said
            err = message(e) if isinstance(e, self.libvirt.libvirtError) else str(e)
            self.run.event("after the migration", error=err)
            self.progress.step(f"after the migration: {err}")
        else:
            journal.remove(self.opts.domain)
            self.dismiss_guard()  # everything put back: nothing left for it

    def dismiss_guard(self) -> None:
        if self.guard is not None:
            self.guard.dismiss()
            self.guard = None

    def _finish_completed(self) -> None:
        o = self.opts
        plan = self.run.plan
        assert plan is not None
        dst = lookup(self.dst_conn, o.domain, o.dst_uri)
        with contextlib.suppress(self.libvirt.libvirtError):
            self.run.completed_stats = dict(dst.jobStats(
                self.libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED))
        if plan.flags & PAUSED:
            guard = self.guard  # started with the settings (prepare)
            assert guard is not None
            self.progress.step(f"comparing the copied disks (disk-check="
                               f"{self.disk_method}); the destination is held paused")
            t0 = time.monotonic()
            self._interruptible = True
            try:
                self.run.disk_check = self._compare_disks(dst)
            except KeyboardInterrupt:  # Ctrl-C / SIGTERM: stop comparing, resume
                self.run.disk_check = {"result": "skipped", "method": self.disk_method,
                                       "why": f"{self.stop_reason}: comparison stopped"}
                self.run.event("disk check stopped", reason=self.stop_reason)
            finally:
                self._interruptible = False
            self.progress.step(f"disks {self.run.disk_check['result']} in "
                               f"{time.monotonic() - t0:.2f} s")
            if self.run.disk_check.get("result") == "mismatch":
                guard.tell(hold.MISMATCH)
                self.progress.step(f"disk mismatch: the destination stays paused (virsh "
                                   f"-c {o.dst_uri} resume {o.domain} runs it anyway)")
            else:
                dst.resume()
                self.run.t_cont = time.time()
                self.run.event("destination resumed")
                # the guest waited for the comparison: a verify hold after QEMU's
                # downtime (not in downtime_ms)
                self.run.disk_check["hold_s"] = round(time.monotonic() - t0, 3)
            guard.tell(hold.DECIDED)  # its settings stay guarded until finish is done
        if plan.ram_check:
            self.run.ram_check = self._ram_check_result(dst)
        stream = [k for k in plan.dst_globals if k in STREAM_PARAMS]
        if stream:  # the destination QEMU's own settings back as they were
            restore = {k: self.restore_params.get(k, "none") for k in stream}
            try:
                qmp.command(dst, "migrate-set-parameters", **restore)
            except LibvirtError as e:
                self.run.event("destination parameters not restored", error=str(e))
        self.run.cpu["destination"] = cpu_seconds(dst)
        state, _ = dst.state()
        self.run.destination = {"running": state == self.libvirt.VIR_DOMAIN_RUNNING,
                                "persistent": bool(dst.isPersistent())}
        still = find(self.src_conn, o.domain)
        self.run.destination["gone_from_source"] = still is None
        self.progress.step(f"{o.domain} runs on {o.dst_uri}" if self.run.destination["running"]
                           else f"{o.domain} is on {o.dst_uri}, paused")

    def _compare_disks(self, dst: Any) -> dict[str, Any]:
        """The copied disks compared while the destination is held paused; ``auto``
        falls back from NBD exports to the image files or volume streams when the
        exports could not be made (nothing was compared)."""
        o = self.opts
        ends = DiskEnds(o.src_uri, o.dst_uri, self.src_conn, self.dst_conn)
        nbd_ends = NbdEnds(o.domain, self.domain_xml, dst, o.request.tls)
        res = compare_copied_disks(ends, self.disks, self.disk_formats, self.disk_method,
                                   o.disk_fault, self.run.event, nbd_ends)
        plan = self.run.plan
        if (res["result"] == "skipped" and self.disk_method == "nbd" and plan is not None
                and plan.disk_check == "auto"):
            other = disk_check_fallback(on_one_machine(o.src_uri, o.dst_uri))
            why = res.get("why")
            self.run.event("disk check falls back", method=other, why=why)
            self.progress.step(f"NBD disk check not possible ({why}); disk-check={other} "
                               "instead")
            res = compare_copied_disks(ends, self.disks, self.disk_formats, other,
                                       o.disk_fault, self.run.event)
            res["nbd_skipped"] = why
        return res

    def _ram_check_result(self, dst: Any) -> dict[str, Any]:
        """The destination's figures of the in-stream check: a completed migration
        with the check means the destination's RAM matched the source's digests."""
        try:
            info = qmp.command(dst, "query-migrate")
        except LibvirtError as e:
            return {"result": "skipped", "method": RAM_CHECK_METHOD,
                    "why": f"the destination's query-migrate failed: {e}"}
        check = (info or {}).get(RAM_CHECK_CAP)
        if not check:
            return {"result": "skipped", "method": RAM_CHECK_METHOD,
                    "why": "the destination reports no RAM check (was the capability "
                           "reset on the source?)"}
        res = ram_check_ok(check)
        self.run.event("RAM check", **res)
        self.progress.step(f"RAM verified in the stream: {res['blocks']} blocks, "
                           f"{res['bytes'] / (1 << 30):.2f} GiB; digest time source "
                           f"{res['source_s']:.3f} s, destination "
                           f"{res['destination_s']:.3f} s")
        return res

    def _finish_source_kept(self) -> None:
        try:
            self._restore_source()
            state, _ = self.dom.state()
            if state == self.libvirt.VIR_DOMAIN_PAUSED:
                # libvirt resumes the source after a failed migration; make sure
                self.dom.resume()
                self.run.event("source resumed")
                state, _ = self.dom.state()
            self.run.source_after = {
                "status": "running" if state == self.libvirt.VIR_DOMAIN_RUNNING
                else f"state {state}",
                "restored": {"parameters": self.restore_params,
                             "capabilities": self.restore_caps,
                             "downtime_ms": self.orig_downtime if self.downtime_changed
                             or (self.actuator is not None and self.actuator.downtime_set)
                             else None}}
        except (self.libvirt.libvirtError, LivemigError) as e:
            err = message(e) if isinstance(e, self.libvirt.libvirtError) else str(e)
            self.run.source_after = {"status": "unknown", "error": err}

    def _restore_source(self) -> None:
        """Undo livemig's own settings on a source that keeps running."""
        self._release()
        if self.restore_params:
            qmp.command(self.dom, "migrate-set-parameters", **self.restore_params)
        if self.restore_caps:
            qmp.command(self.dom, "migrate-set-capabilities", capabilities=[
                {"capability": k, "state": v} for k, v in self.restore_caps.items()])
        changed = self.downtime_changed or (self.actuator is not None
                                            and self.actuator.downtime_set)
        if changed and self.orig_downtime is not None:
            with contextlib.suppress(self.libvirt.libvirtError):
                if int(self.dom.migrateGetMaxDowntime(0)) != self.orig_downtime:
                    self.dom.migrateSetMaxDowntime(self.orig_downtime, 0)
        self.run.event("source settings restored")

    def cleanup(self) -> None:
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        if self._job is not None and self._job.running:
            return  # a call still runs on these connections: leave them to the exit
        for ev in self._event_ids:
            with contextlib.suppress(Exception):
                self.src_conn.domainEventDeregisterAny(ev)
        for c in (self._mig_conn, self.src_conn, self.dst_conn):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()


class _Hooks:
    """The monitor's hooks of a libvirt run (libvirt does the switchover and knows
    its destination: no pre-switchover hand-over, no destination process to watch)."""

    def __init__(self, m: DomainMigration, job: DomainJob) -> None:
        self.m, self.job = m, job

    async def on_poll(self, now: float, obs: Observation) -> dict[str, Any]:
        return self.m._on_poll(self.job, obs)

    def disk_observation(self) -> dict[str, Any] | None:
        return self.m._disk_obs

    async def pre_switchover(self) -> bool:
        return False

    def destination_dead(self) -> str | None:
        return None


def run_domain_migration(opts: DomainOptions, progress: Progress,
                         on_prepared: Callable[[DomainMigration], None] | None = None
                         ) -> DomainRun:
    """One migration of the domain; once more, with what a stock QEMU has, when the
    destination's QEMU refused one of the patched build's mechanisms (a host not yet
    upgraded, or rolled back): at its start, before any guest state is sent, or, when
    the plan gave it nothing to refuse there, the in-stream RAM check's section at
    the end of the stream. Either way the source kept running."""
    run = _attempt(opts, progress, on_prepared)
    refused = None if opts.stock_peer else refused_global(
        run.result.reason if run.result.outcome == "failed" else None)
    if refused is None:
        return run
    why = (f"the destination's QEMU has no {refused} (not the patched build): "
           "again with what a stock QEMU has")
    progress.step(why)
    if opts.stock_found:  # the caller's other migrations toward it need not try
        try:
            with open(opts.stock_found, "w") as f:
                f.write(refused)
        except OSError as e:
            log.info("%s not written: %s", opts.stock_found, e)
    again = _attempt(dataclasses.replace(opts, stock_peer=True), progress, on_prepared)
    again.events.insert(0, {"t": 0.0, "event": "retried for a stock destination",
                            "refused": refused, "first_attempt_s": round(
                                (run.t_end or time.time()) - run.t0, 3),
                            "first_reason": run.result.reason})
    return again


def _attempt(opts: DomainOptions, progress: Progress,
             on_prepared: Callable[[DomainMigration], None] | None) -> DomainRun:
    m = DomainMigration(opts, progress)
    libvirt = libvirt_module()
    try:
        m.prepare()
        if on_prepared:
            on_prepared(m)
        m.migrate()
        # after the call libvirt has decided: a signal now is noted, the bookkeeping
        # (restores, checks, the report) finished; it stops only a disk comparison
        with m._signals():
            m.finish()
        if m.stop_reason is not None and m.run.result.outcome == "completed":
            m.run.event("stop asked once the migration had completed: finished, not "
                        "undone", reason=m.stop_reason)
    except libvirt.libvirtError as e:  # before the migration started: one line
        if m.run.t_migrate is None and m.dom is not None:
            with contextlib.suppress(Exception):
                m._restore_source()
                journal.remove(opts.domain)
                m.dismiss_guard()
        raise LibvirtError(message(e)) from None
    except BaseException:
        # a failure before the migration started: undo what prepare() set
        if m.run.t_migrate is None and m.dom is not None:
            with contextlib.suppress(Exception):
                m._restore_source()
                journal.remove(opts.domain)
                m.dismiss_guard()
        raise
    finally:
        m.cleanup()
    return m.run


def ram_check_ok(check: dict[str, Any]) -> dict[str, Any]:
    """The report's ``consistency.ram_detail`` from QEMU's ``x-ram-digest-check``
    figures (times in microseconds, both in the downtime)."""
    size = int(check["size"])
    src = int(check["source-time"]) / 1e6
    dst = int(check.get("destination-time", 0)) / 1e6
    gib = size / (1 << 30)
    return {"result": "ok", "method": RAM_CHECK_METHOD, "blocks": int(check["blocks"]),
            "bytes": size, "chunk_size": int(check["chunk-size"]),
            "source_s": round(src, 6), "destination_s": round(dst, 6),
            "cost_s_per_gib": {"source": round(src / gib, 4) if gib else None,
                               "destination": round(dst / gib, 4) if gib else None},
            "in_downtime": True,
            # threads a side digested with (patch 0017: its multifd channels); absent
            # before that patch
            **({"threads": int(check["threads"])} if "threads" in check else {})}


def ram_check_failed(reason: str) -> dict[str, Any]:
    """``consistency.ram_detail`` of a migration that did not complete: a mismatch when
    QEMU failed it for one (its message names the RAM block and chunk)."""
    marker = f"{RAM_CHECK_CAP}: guest RAM differs"
    if marker in reason:
        return {"result": "mismatch", "method": RAM_CHECK_METHOD,
                "detail": reason[reason.index(marker):].strip()}
    if f"{RAM_CHECK_CAP}:" in reason:
        return {"result": "skipped", "method": RAM_CHECK_METHOD,
                "why": "the check could not compare: "
                       + reason[reason.index(f"{RAM_CHECK_CAP}:"):].strip()}
    return {"result": "skipped", "method": RAM_CHECK_METHOD,
            "why": "the migration did not complete"}
