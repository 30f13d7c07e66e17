"""The engine: one migration between two QMP endpoints, from plan to record.

Phases (libvirt's naming, one method each)::

    negotiate ─▶ incoming ─▶ [disk first ─▶] migrate ─▶ monitor ─┬▶ switchover ─▶ verify ─▶ resume
                                                            └▶ cancelled / failed ─▶ source runs on

One loop (:class:`Monitor`) from the start of the migration: when the caller copies
its disk first, the monitor starts before ``migrate`` and issues it at the tick the
copy is ready; otherwise ``migrate`` is issued and the monitor follows it.

Rollback rule: until the destination has been resumed, the source is the VM.
Whatever goes wrong before that point, the source is left (or put back) running;
the engine never kills a QEMU (the caller owns the processes). Whatever the
outcome, every capability and parameter changed on either end is set back, and a
detached guardian (:mod:`livemig.engine.guardian`) makes the same repairs if this
process dies on the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.engine import guardian, pinning
from livemig.engine.actuator import DiskTargets
from livemig.engine.adapt import Deferred
from livemig.engine.endpoint import QmpEnd
from livemig.engine.events import EventStream
from livemig.engine.executor import SWITCHOVER_BW, PolicyConfig, PolicyExecutor
from livemig.engine.monitor import Monitor
from livemig.engine.negotiate import Negotiated, apply, negotiate, restore
from livemig.engine.observe import TERMINAL, Observation
from livemig.engine.plan import Plan
from livemig.engine.qmpactuator import QmpActuator, check_throttle
from livemig.engine.record import MigrationRecord
from livemig.engine.second_look import Beside
from livemig.engine.sockstat import link_state, tcp_port
from livemig.engine.stall import SwitchoverWatch
from livemig.engine.vcpushare import VcpuShare, schedstat_reader
from livemig.engine.verify import RamVerdict, skipped, verify_ram
from livemig.errors import LivemigError, UsageError, VMError
from livemig.settings import ram_check_budget_s

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

DST_LOAD_TIMEOUT_S = 60.0
LOOK_S = 0.5  # how often the kernel's view of the last bytes is read meanwhile
MISMATCH_NAMED = 4  # pages named in the one-line reason (the report lists up to 16)
PAUSED = ("paused", "postmigrate", "finish-migrate", "prelaunch", "inmigrate")


class Interrupted(LivemigError):
    """Ctrl-C or SIGTERM during a run."""


class Hooks:
    """What a caller may add around the migration; the defaults do nothing (attach).

    The lab overrides them: warm-up, disk mirror, thread pinning, guest metrics in
    the timeline, fault injection before the comparison, the disk comparison."""

    def disk_targets(self) -> DiskTargets | None:
        """What the disk policies act on when the caller copies the disk (the plan's
        ``disk_link`` is the link they share); None: no disk policies."""
        return None

    async def warmup(self) -> None:
        return None

    async def start_disk_copy(self) -> bool:
        """The migration starts (``t_migrate``): start the caller's disk copy, if any.
        True: disk first, ``migrate`` waits until :meth:`disk_observation` says
        ``ready`` (the monitor looks at each tick); False: the RAM starts at once."""
        return False

    async def before_ram(self) -> None:
        """``migrate`` is about to be issued (a disk copied first is ready)."""

    async def on_poll(self, now: float, obs: Observation) -> dict[str, Any]:
        return {}

    def disk_observation(self) -> dict[str, Any] | None:
        return None

    async def pre_switchover(self) -> bool:
        """QEMU stopped at pre-switchover: handle it and return True, or False."""
        return False

    def destination_dead(self) -> str | None:
        return None

    def guardian_extra(self) -> dict[str, Any]:
        """What else the guardian must undo if livemig dies (the lab: its disk mirror
        job and the IO cap on the guest's disk)."""
        return {}

    async def before_verify(self) -> None:
        return None

    async def verify_more(self) -> str | None:
        """More comparisons with both ends frozen (the lab: the disk images); a
        mismatch is returned as a one-line description, and fails the migration."""
        return None

    async def after_resume(self) -> None:
        return None

    async def after_failure(self) -> None:
        return None


@dataclass
class _State:
    t_migrate: float | None = None
    t_ram: float | None = None
    t_dst_done: float | None = None
    t_cont: float | None = None
    outcome: str = "failed"
    reason: str | None = None
    final: dict[str, Any] | None = None
    ram: RamVerdict | None = None
    source_after: dict[str, Any] | None = None
    dst_status: str | None = None
    postcopy: bool = False  # the destination ran in post-copy (livemig resumed it)


class Engine:
    """Drives one migration from ``src`` to ``dst`` as the plan says."""

    def __init__(self, src: QmpEnd, dst: QmpEnd, plan: Plan, *,
                 events: EventStream | None = None, hooks: Hooks | None = None,
                 interrupt: asyncio.Event | None = None, run_id: str | None = None,
                 guardian_dir: Path | None = None,
                 encoding: dict[str, Any] | None = None,
                 deferred: Deferred | None = None) -> None:
        self.src, self.dst, self.plan = src, dst, plan
        self.encoding = encoding  # what the second plan's encoding came from (adapt)
        self.deferred = deferred  # the choice made beside the first pass (adapt)
        self._beside: Beside | None = None  # the deferred choice's switch and second look
        self.events = events or EventStream()
        self.hooks = hooks or Hooks()
        self.interrupt = interrupt or asyncio.Event()
        self.id = run_id or uuid.uuid4().hex[:8]
        self.guardian_dir = guardian_dir
        self.neg: Negotiated | None = None
        self.executor: PolicyExecutor | None = None
        self.timeline: list[dict[str, Any]] = []
        self.s = _State()
        self.cpu: dict[str, float | None] = {}
        self.restored: dict[str, Any] = {}
        self._guardian: guardian.Handle | None = None
        self.pinner: pinning.ThreadPinner | None = None
        self.pinning: dict[str, Any] | None = None  # what was pinned, for the report
        self._vcpus: tuple[int, list[int]] | None = None  # (count, thread ids): _vcpu_threads

    # -- the run ----------------------------------------------------------------------
    async def run(self) -> MigrationRecord:
        try:
            await self._run()
        except Interrupted as e:
            await self._rollback("aborted", str(e))
        except UsageError as e:
            if self.s.t_migrate is None:  # nothing started: put settings back, tell
                await self._finish()
                raise
            await self._rollback("failed", str(e))
        except (LivemigError, OSError) as e:
            await self._rollback("failed", str(e))
        await self._finish()
        return self.record()

    async def _run(self) -> None:
        p = self.plan
        self.neg = await negotiate(self.src, self.dst, p)
        if self.neg.unused:
            self.events.say(f"not used: {', '.join(self.neg.unused)}: the source QEMU has "
                            "them, the destination's does not")
            self.events.event("not applied", settings=list(self.neg.unused),
                              why="the destination QEMU lacks them")
        params = self.neg.original_src.parameters
        commands = {c["name"] for c in await self.src.cmd("query-commands")}
        lm = self.neg.resolved.livemig
        check_throttle(str(lm.get("throttle", "off")), p.accel, commands)
        disk = self.hooks.disk_targets()
        downtime = int(self.neg.parameters.get("downtime-limit",
                                               params.get("downtime-limit", 300)))
        cfg = PolicyConfig.from_settings(lm, downtime, ram_cap=p.bandwidth,
                                         disk_link=p.disk_link if disk else None)
        if SWITCHOVER_BW in p.explicit:  # the user's own value stays
            cfg = dataclasses.replace(cfg, switchover_bandwidth=False)
        self.executor = PolicyExecutor(
            cfg,
            QmpActuator(self.src.cmd, disk), lambda what, data: self.events.event(what, **data))
        self.executor.after_first_pass(self.encoding)
        await self._plan_pinning(str(lm.get("pin", "off")))
        if self.guardian_dir is not None:  # before the first setting is changed
            self._guardian = guardian.start(self._guardian_spec(), self.guardian_dir)
        await apply(self.src, self.dst, self.neg)
        self.events.event("settings applied", **self.neg.resolved.as_dict())
        if self.pinner is not None:
            self.pinner.apply()
        await self._incoming()
        self.events.event("phase warmup")
        await self.hooks.warmup()
        self._check_interrupt()
        self.events.event("phase migrating")
        self.cpu["source_before"] = proc_cpu(self.src.pid)
        self.s.t_migrate = time.time()
        disk_first = await self.hooks.start_disk_copy()
        mon = Monitor(self.src, self.events, float(self.neg.resolved.livemig["poll-interval"]),
                      self.s.t_migrate, p.max_time, self.interrupt, self.executor,
                      self.hooks, self.timeline, dst=self.dst,
                      stall_timeout=float(self.neg.resolved.livemig["stall-timeout"]),
                      release=self._release_controls,
                      on_tick=self.pinner.apply if self.pinner is not None else None,
                      switchover=self._switchover_watch(),
                      on_postcopy=self._postcopy_resume,
                      start_ram=self._start_ram if disk_first else None,
                      vcpus=await self._vcpu_share())
        if not disk_first:
            await self._start_ram()
        end = await mon.run()
        await self._switch_done()  # a sample still running is moot now
        if self.s.t_ram is None:  # stopped while the disk copied first: no migrate issued
            raise Interrupted(end.cancelled_for or "cancelled")
        self.s.final = end.info
        if end.status == "completed":
            await self._switchover()  # the source's controls go once it is not the VM
            return
        await self._release_controls()
        if end.status == "cancelled":
            self.s.outcome, self.s.reason = "aborted", end.cancelled_for or "cancelled"
            await self._back_to_source()
        else:
            raise VMError(f"migration {end.status}: "
                          f"{end.cancelled_for or end.info.get('error-desc', '?')}")

    async def _start_ram(self) -> None:
        """``migrate``: the RAM starts (from the monitor's loop when the disk went first)."""
        await self.hooks.before_ram()
        self.s.t_ram = time.time()
        await self.src.cmd("migrate", uri=self.plan.uri)
        self.events.say("migration started")
        if self.deferred is not None and self.neg is not None:
            self._beside = Beside.start(self.src, self.deferred, self.encoding or {},
                                        self.neg.original_src.parameters, self.events,
                                        self.executor)

    async def _switch_done(self) -> None:
        """The encoding switch's outcome into the report; a sample still running when
        the migration ended is stopped (the stream kept its start encoding)."""
        beside, self._beside = self._beside, None
        if beside is not None:
            self.encoding = await beside.outcome(self.encoding, self.events)

    async def _postcopy_resume(self) -> bool:
        """Post-copy began: the destination (started with ``-S``, as every
        destination livemig drives) runs the guest as soon as QEMU handed it over,
        as libvirt does, or the guest would stay paused until the last page arrived.
        True once it runs. The guardian is told first: from here on the destination
        is the VM (the source never resumes; its RAM is no longer the guest's)."""
        status = (await self.dst.cmd("query-status")).get("status")
        if status == "running":
            return True
        if status not in PAUSED:
            return False  # still loading the device state: look again next poll
        if self._guardian is not None:
            self._guardian.tell(guardian.VERIFIED)
        await self.dst.cmd("cont")
        self.s.t_cont = time.time()
        self.s.postcopy = True
        self.events.event("destination resumed in post-copy", was=status)
        self.events.say("post-copy: the guest runs on the destination, which pulls the "
                        "pages it still lacks from the source")
        return True

    def _switchover_watch(self) -> SwitchoverWatch | None:
        """The final send watched through the kernel while QMP is blocked (a local
        source QEMU on a ``tcp:`` URI; see :mod:`livemig.engine.stall`)."""
        port, pid = tcp_port(self.plan.uri), self.src.pid
        if port is None or pid is None or self.neg is None:
            return None
        return SwitchoverWatch(float(self.neg.resolved.livemig["stall-timeout"]),
                               lambda: link_state(pid, port))

    async def _incoming(self) -> None:
        """The destination listens. ``exit-on-error=false`` (QEMU >= 9.1): a failed
        or cancelled migration leaves the destination QEMU up for its owner to decide
        about, instead of QEMU exiting by itself."""
        try:
            await self.dst.cmd("migrate-incoming", uri=self.plan.uri, **{"exit-on-error": False})
        except VMError as e:
            if "exit-on-error" not in str(e):
                raise
            await self.dst.cmd("migrate-incoming", uri=self.plan.uri)

    async def _switchover(self) -> None:
        self.events.event("phase switched")
        self.cpu["source"] = _delta(proc_cpu(self.src.pid), self.cpu.get("source_before"))
        done = await self._wait_destination_done()
        # in post-copy the destination ran before it was done: no hold to count
        self.s.t_dst_done = self.s.t_cont if self.s.postcopy else done
        await self.hooks.before_verify()
        status = (await self.dst.cmd("query-status")).get("status")
        if self.plan.verify:
            self.events.event("phase verifying")
            if self.s.postcopy:
                self.s.ram = skipped("post-copy: the destination ran before all of its "
                                     "RAM had arrived (the guest's own checker is the "
                                     "verification there)")
            elif status == "running":
                self.s.ram = skipped("the destination runs already (not started with -S)")
            else:
                self.events.say("comparing guest RAM: source vs destination")
                lm = self.neg.resolved.livemig if self.neg else {}
                self.s.ram = await verify_ram(self.src, self.dst,
                                              str(lm.get("ram-check", "auto")),
                                              ram_check_budget_s(lm))
                self.events.event("ram compared", **self.s.ram.as_dict())
                disk_bad = await self.hooks.verify_more()
                bad = mismatch_reason(self.s.ram, disk_bad)
                if bad is not None and not self.plan.resume_corrupt:
                    await self._refuse_destination(bad)
                    return
                if bad is not None:
                    self.events.event("corrupt destination resumed (resume_corrupt)",
                                      reason=bad)
        if self._guardian is not None:  # should livemig die now: the destination runs
            self._guardian.tell(guardian.VERIFIED)
        if status in PAUSED:
            await self.dst.cmd("cont")
            self.s.t_cont = time.time()
        self.s.outcome = "completed"
        # the source is stopped: its throttle and IO caps are released off the pause
        with contextlib.suppress(LivemigError, OSError):
            await self._release_controls()
        self.events.say("the guest runs on the destination")
        self.events.event("phase settling")
        await self.hooks.after_resume()
        self.cpu["destination"] = proc_cpu(self.dst.pid)
        self.s.dst_status = (await self.dst.cmd("query-status")).get("status")
        self.events.event("destination after", status=self.s.dst_status)
        if self.s.dst_status != "running":
            raise VMError(f"destination is {self.s.dst_status} after the migration")

    async def _refuse_destination(self, reason: str) -> None:
        """The destination is proven corrupt: it never runs. It stays paused (its
        disks inactivated, so the source can take them back); the source, frozen in
        postmigrate and intact, resumes. The caller quits a destination it started."""
        self.s.outcome, self.s.reason = "failed", reason
        if self._guardian is not None:  # should livemig die now: the source, not dst
            self._guardian.tell(guardian.REFUSE_DESTINATION)
        self.events.event("phase failed: " + reason)
        self.events.say(f"failed: {reason}; the destination stays paused, the source "
                        "resumes")
        with contextlib.suppress(LivemigError, OSError):
            await self._release_controls()  # before the source runs again
            if await self.dst.has_command("blockdev-set-active"):
                await self.dst.cmd("blockdev-set-active", active=False)
        await self._back_to_source()
        with contextlib.suppress(LivemigError, OSError):
            self.s.dst_status = (await self.dst.cmd("query-status")).get("status")
            self.events.event("destination after", status=self.s.dst_status)

    async def _wait_destination_done(self) -> float:
        """When the destination finished loading: QEMU's MIGRATION event timestamp,
        so livemig's polling latency does not count as pause."""
        deadline = time.monotonic() + DST_LOAD_TIMEOUT_S
        watch, next_look = self._switchover_watch(), 0.0  # the last bytes' link
        while time.monotonic() < deadline:
            if watch is not None and time.monotonic() >= next_look:
                next_look = time.monotonic() + LOOK_S
                reason = watch.feed(time.monotonic(), await asyncio.to_thread(watch.progress))
                if reason:
                    raise VMError(f"the destination cannot finish loading: {reason}")
            ev = await self.dst.next_event(0.05)
            if ev is not None and ev.get("event") == "MIGRATION":
                status = ev.get("data", {}).get("status")
                if status == "completed":
                    ts = ev.get("timestamp", {})
                    return float(ts.get("seconds", 0)) + float(ts.get("microseconds", 0)) / 1e6
                if status == "failed":
                    info = await self.dst.cmd("query-migrate")
                    raise VMError(f"destination failed to load: {info.get('error-desc', '?')}")
            dead = self.hooks.destination_dead()
            if dead:
                raise VMError(dead)
        raise VMError(f"destination did not finish loading within {DST_LOAD_TIMEOUT_S:.0f}s")

    # -- failure ----------------------------------------------------------------------
    async def _rollback(self, outcome: str, reason: str) -> None:
        log.info("rollback: %s: %s", outcome, reason)
        self.events.say(f"{outcome}: {reason}")
        if self.s.outcome == "completed":
            # switched over already: the destination is the VM now; only record
            self.s.outcome, self.s.reason = "failed", reason
            self.events.event("phase failed: " + reason)
            return
        self.s.outcome, self.s.reason = outcome, reason
        self.events.event("phase failed: " + reason)
        if not self.src.alive() or self.s.t_migrate is None:
            return
        with contextlib.suppress(LivemigError, OSError):
            await self._release_controls()
            await self.hooks.after_failure()
            info = await self.src.cmd("query-migrate")
            if str(info.get("status")).startswith("postcopy"):
                # the destination runs the guest and the source holds pages it lacks:
                # cancelling loses the guest, resuming the source runs it twice
                self.s.final = info
                self.s.source_after = {"running": False, "error": (
                    f"post-copy ({info.get('status')}): the source is left as it is")}
                self.events.event("source not resumed", **self.s.source_after)
                return
            if info.get("status") not in (*TERMINAL, None, "none"):
                await self.src.cmd("migrate_cancel")
                info = await self._wait_source_terminal()
            self.s.final = info
        await self._source_runs()

    async def _wait_source_terminal(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for _ in range(400):
            info = await self.src.cmd("query-migrate")
            if info.get("status") in TERMINAL:
                break
            await asyncio.sleep(0.05)
        return info

    async def _destination_held(self) -> bool:
        """The split-brain guard, before the source resumes: True once the
        destination is confirmed not running. A destination not running gets
        ``stop``: on a QEMU still loading (``inmigrate``) that only clears autostart,
        so one started without ``-S`` cannot start by itself should its load finish
        late. A running one is never stopped: it is the VM now."""
        if not self.dst.alive():
            return True
        try:
            status = (await self.dst.cmd("query-status")).get("status")
            if status != "running":
                with contextlib.suppress(VMError):
                    await self.dst.cmd("stop")
                status = (await self.dst.cmd("query-status")).get("status")
        except (LivemigError, OSError):
            return not self.dst.alive()  # unreachable but alive: not confirmed
        return bool(status != "running")

    async def _back_to_source(self) -> None:
        """A migration that will not complete: the caller gives up what it ran beside
        it (a disk copy), and the source runs."""
        with contextlib.suppress(LivemigError, OSError):
            await self.hooks.after_failure()
        await self._source_runs()

    async def _source_runs(self) -> None:
        """After a cancel or failure: the source must run (``cont`` if QEMU left it
        paused after a failed switchover) — unless the destination runs the guest."""
        after: dict[str, Any] = {"running": False}
        if not await self._destination_held():
            after["error"] = ("the destination runs the guest (or cannot be confirmed "
                              "stopped): the source is left as it is (split-brain guard)")
            self.events.event("source not resumed", **after)
            self.s.source_after = after
            return
        try:
            status = (await self.src.cmd("query-status")).get("status")
            if status in ("postmigrate", "paused", "finish-migrate"):
                self.events.event("source was left paused; resuming it", status=status)
                await self.src.cmd("cont")
                status = (await self.src.cmd("query-status")).get("status")
            after["status"] = status
            after["running"] = status == "running"
        except LivemigError as e:
            after["error"] = str(e)
        self.cpu["source"] = _delta(proc_cpu(self.src.pid), self.cpu.get("source_before"))
        self.s.source_after = after

    async def _plan_pinning(self, mode: str) -> None:
        """Pin the source's threads when the policy says so and its QEMU is on this
        host; the vCPUs' affinities are taken first, for the restore and the guardian."""
        if mode == "off":
            return
        count, tids = await self._vcpu_threads()
        self.pinner, why = pinning.plan_for(self.src.pid, count, mode,
                                            tids if len(tids) == count else None)
        self.pinning = (self.pinner.as_report() if self.pinner is not None
                        else {"mode": mode, "applied": False, "reason": why})
        self.events.event("pinning", **{k: v for k, v in self.pinning.items()
                                        if k != "threads"})

    async def _vcpu_threads(self) -> tuple[int, list[int]]:
        """The source's vCPU count and the thread ids QMP names for them
        (``query-cpus-fast``), asked once: pinning and the vCPU share both need them."""
        if self._vcpus is None:
            cpus = await self.src.cmd("query-cpus-fast")
            self._vcpus = (len(cpus), [int(c["thread-id"]) for c in cpus
                                       if "thread-id" in c])
        return self._vcpus

    async def _vcpu_share(self) -> VcpuShare | None:
        """The source's vCPUs' share of the CPU they ask for, read from this host's
        kernel when its QEMU runs here (the converge throttle's long-round cap follows
        it); None, said in the events, when it cannot be read."""
        pid = self.src.pid
        if pid is None:
            self.events.event("vcpu share not read", reason="the source QEMU is not a "
                              "process on this host")
            return None
        try:
            tids = (await self._vcpu_threads())[1]
        except (LivemigError, TypeError, ValueError):  # a QEMU that will not say
            tids = []
        meter = VcpuShare(schedstat_reader(pid, tids)) if tids else None
        if meter is None or not meter.reading:
            self.events.event("vcpu share not read", reason="no scheduler statistics "
                              f"for the source's vCPU threads {tids}")
            return None
        return meter

    async def _release_controls(self) -> None:
        """No throttle and no IO cap survive the migration, whatever its outcome."""
        if self.executor is not None and self.src.alive():
            await self.executor.release()
        with contextlib.suppress(LivemigError):
            if self.src.alive() and await self.src.has_command("cancel-cpu-throttle"):
                await self.src.cmd("cancel-cpu-throttle")

    async def _finish(self) -> None:
        """Put back every setting changed on either end; dismiss the guardian."""
        await self._switch_done()
        if self.neg is not None:
            for name, end, orig in (("source", self.src, self.neg.original_src),
                                    ("destination", self.dst, self.neg.original_dst)):
                if not end.alive():
                    continue
                try:
                    self.restored[name] = await restore(end, orig)
                except (LivemigError, OSError) as e:
                    self.restored[name] = {"errors": [str(e)]}
            self.events.event("settings restored", **self.restored)
        if self.pinner is not None:
            self.pinning = self.pinner.as_report()
            undone = self.pinner.restore()
            if undone:
                self.events.event("pinning undone", threads=undone)
        if self._guardian is not None:
            self._guardian.dismiss()
            self._guardian = None
        self.t_end = time.time()

    def _guardian_spec(self) -> dict[str, Any]:
        assert self.neg is not None
        return {
            "src": str(getattr(self.src, "socket_path", "")),
            "dst": str(getattr(self.dst, "socket_path", "")),
            "run_id": self.id,
            "verify": self.plan.verify,  # until told VERIFIED, the source is the VM
            "original_src": self.neg.original_src.as_dict(),
            "original_dst": self.neg.original_dst.as_dict(),
            **({"affinity": {str(t): c for t, c in self.pinner.originals.items()}}
               if self.pinner is not None else {}),
            **self.hooks.guardian_extra(),
        }

    def _check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise Interrupted("interrupted")

    # -- result -----------------------------------------------------------------------
    def record(self) -> MigrationRecord:
        s = self.s
        return MigrationRecord(
            run_id=self.id, uri=self.plan.uri, t0=self.events.t0, t_migrate=s.t_migrate,
            t_ram=s.t_ram, t_end=getattr(self, "t_end", time.time()),
            t_dst_done=s.t_dst_done, t_cont=s.t_cont, outcome=s.outcome, reason=s.reason,
            final_stats=dict(s.final or {}),
            settings=self.neg.resolved.as_dict() if self.neg else {},
            timeline=tuple(self.timeline), events=tuple(self.events.log), ram=s.ram,
            verify=self.plan.verify, source_after=s.source_after,
            restored=dict(self.restored), cpu=dict(self.cpu),
            destination_status=s.dst_status, plan=self.plan, encoding=self.encoding,
            pinning=self.pinning)


def mismatch_reason(ram: RamVerdict | None, disk: str | None) -> str | None:
    """Why the destination must not run, or None: RAM pages (the first few named,
    with the total) and whatever the disk comparison found."""
    parts = []
    if ram is not None and ram.result == "mismatch":
        first = ", ".join(ram.first_mismatches[:MISMATCH_NAMED])
        more = "" if len(ram.first_mismatches) <= MISMATCH_NAMED else ", ..."
        n = ram.mismatched_pages or ram.mismatched_chunks
        unit = "page" if ram.mismatched_pages else "chunk"
        parts.append(f"destination RAM differs from the source in {n} {unit}"
                     f"{'' if n == 1 else 's'}{' or more' if ram.capped else ''} "
                     f"(first: {first}{more})")
    if disk:
        parts.append(disk)
    return "; ".join(parts) or None


def proc_cpu(pid: int | None) -> float | None:
    """User+system CPU seconds of a local process, or None."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    import os

    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)
