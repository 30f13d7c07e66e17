"""The monitor: one fixed-period loop with absolute deadlines.

Each period the source (:class:`MigrationSource`: the source QEMU's QMP, or
libvirt's migration job adapted to it) is polled once (``query-migrate``), the reply
parsed once into an :class:`Observation` (with the vCPUs' share of the CPU they asked
for, when a :class:`~livemig.engine.vcpushare.VcpuShare` reads it), the policies run
(the executor returns a :class:`Verdict`), and then the loop waits for the next tick
— woken early by the source's ``MIGRATION`` events and by the end of the first pass
(``MIGRATION_PASS`` 2).
Whatever decides to cancel (a policy, ``--max-time``, Ctrl-C, a dead destination)
goes through the same ``migrate_cancel``; the loop then runs on until QEMU
reports a terminal state. Once the migration is in post-copy nothing cancels it (the
destination runs the guest, the source holds the pages it still lacks: a cancel
would lose the guest), and ``on_postcopy`` (the engine's: resume the destination)
runs at each poll until it says it is done.

When the caller copies its disk before the RAM (``start_ram`` given), the loop
begins in a disk-first phase: there is no migration yet, so QEMU is not asked
(a source that was itself migrated in reports that incoming one as completed);
each tick observes the caller's disk copy (``on_poll``, ``disk_observation``), feeds
the timeline and the progress line, ticks the policies with a disk-only snapshot and
applies the same limits (``--max-time``, Ctrl-C, a dead destination), and at the tick
the disk observation says ``ready`` issues ``migrate`` (``start_ram``). Stopped before
that, the loop returns ``cancelled`` with nothing to cancel in QEMU; the engine
rolls back (the caller abandons its copy, the source runs on).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from livemig.engine.decision import CONTINUE, Decision, Verdict
from livemig.engine.endpoint import QmpEnd
from livemig.engine.events import EventStream
from livemig.engine.observe import DISK_FIRST, POLICY_STATES, Observation
from livemig.engine.stall import StallWatch, SwitchoverWatch
from livemig.engine.vcpushare import VcpuShare
from livemig.errors import VMError
from livemig.policy.base import Snapshot

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

CANCEL_TIMEOUT_S = 60.0  # QEMU must reach a terminal state this long after a cancel
# How often the switchover watch looks at the final send while QMP is blocked: one
# ``ss`` in the source's namespace (a few ms) per look; the yank comes at most this
# late after ``stall-timeout``.
LOOK_S = 0.5
YANK_MIGRATION = [{"type": "migration"}]
# QEMU's MIGRATION_PASS ``pass`` (its dirty-sync-count) when the first pass is over
FIRST_PASS_OVER = 2
# migrate-start-postcopy asked: QEMU enters post-copy at its next iteration, well
# within this; if it has not (the command was refused), the run's limits apply again
POSTCOPY_GRACE_S = 10.0


class Policies(Protocol):
    """The policy executor as the monitor sees it
    (:class:`livemig.engine.executor.PolicyExecutor`)."""

    @property
    def active(self) -> bool: ...

    async def tick(self, s: Snapshot) -> Verdict: ...


class MigrationSource(Protocol):
    """What the monitor polls and cancels, in QEMU's terms: ``query-migrate`` and
    ``migrate_cancel`` (``cmd``), and the ``MIGRATION``/``MIGRATION_PASS`` events
    that wake it (``next_event``). The source QEMU's own QMP (any
    :class:`~livemig.engine.endpoint.QmpEnd`: lab, attach), or a caller's adapter
    of a migration it does not run itself (libvirt's job: ``virt/job.py``); one with
    an ``oob`` command can be yanked (:class:`SwitchoverWatch`)."""

    async def cmd(self, command: str, **args: Any) -> Any: ...

    async def next_event(self, timeout: float) -> dict[str, Any] | None: ...


class MonitorHooks(Protocol):
    async def on_poll(self, now: float, obs: Observation) -> dict[str, Any]: ...

    def disk_observation(self) -> dict[str, Any] | None: ...

    async def pre_switchover(self) -> bool: ...

    def destination_dead(self) -> str | None: ...


@dataclass(frozen=True)
class Terminal:
    status: str  # completed | failed | cancelled
    info: dict[str, Any]
    cancelled_for: str | None


class Monitor:
    def __init__(self, src: MigrationSource, events: EventStream, period: float,
                 t_migrate: float, max_time: float | None, interrupt: asyncio.Event,
                 policies: Policies | None, hooks: MonitorHooks,
                 timeline: list[dict[str, Any]], dst: QmpEnd | None = None,
                 stall_timeout: float = 0.0,
                 release: Callable[[], Awaitable[None]] | None = None,
                 on_tick: Callable[[], None] | None = None,
                 switchover: SwitchoverWatch | None = None,
                 on_postcopy: Callable[[], Awaitable[bool]] | None = None,
                 start_ram: Callable[[], Awaitable[None]] | None = None,
                 vcpus: VcpuShare | None = None) -> None:
        self.src = src
        self.dst = dst
        self.events = events
        self.period = period
        self.t_migrate = t_migrate
        self.max_time = max_time
        self.interrupt = interrupt
        self.policies = policies
        self.hooks = hooks
        self.timeline = timeline
        self.passes = 0
        self.stall = StallWatch(stall_timeout)
        self.release = release  # drops the throttle the moment a cancel is decided
        self.on_tick = on_tick  # the engine's own per-poll work (thread pinning)
        self.switchover = switchover
        self.yanked: str | None = None  # why the migration was yanked, once it was
        self.on_postcopy = on_postcopy
        self.postcopy_done = False  # on_postcopy said the destination runs
        self.postcopy_noted = False  # a stop asked in post-copy was said once
        self.postcopy_asked: float | None = None  # when migrate-start-postcopy was issued
        # disk first: issues ``migrate`` once the disk copy is ready (None: RAM started)
        self.start_ram = start_ram
        self.vcpus = vcpus  # the vCPUs' share of the CPU they ask for, read each poll

    async def run(self) -> Terminal:
        start = time.monotonic()
        tick = 0
        cancelled_for: str | None = None
        cancel_deadline: float | None = None
        while True:
            now = time.time()
            if self.on_tick is not None:
                self.on_tick()
            info = ({"status": DISK_FIRST} if self.start_ram is not None  # no migration yet
                    else await self._query())
            obs = Observation.parse(now - self.t_migrate, info)
            if self.vcpus is not None:
                obs = replace(obs, vcpu_share=await asyncio.to_thread(self.vcpus.poll))
            sample = {**obs.sample(), **await self.hooks.on_poll(now, obs)}
            self.timeline.append(sample)
            self.events.sample(obs.t, sample)
            if self.start_ram is not None:
                stop = await self._disk_first(obs)
                if stop is not None:
                    return Terminal("cancelled", {}, stop)
            elif obs.terminal:
                why = cancelled_for if obs.status == "cancelled" else \
                    self.yanked if obs.status == "failed" else None
                return Terminal(obs.status, await self.src.cmd("query-migrate"), why)
            elif obs.status == "pre-switchover" and not cancelled_for \
                    and await self.hooks.pre_switchover():
                continue
            elif obs.status.startswith("postcopy"):
                await self._postcopy(obs)
            elif cancelled_for is None:
                verdict = await self._decide(obs)
                if verdict.decision is Decision.CANCEL:
                    cancelled_for = verdict.reason
                    cancel_deadline = time.monotonic() + CANCEL_TIMEOUT_S
                    self.events.event("phase cancelling: " + cancelled_for)
                    self.events.say(f"cancelling: {cancelled_for}")
                    if self.release is not None:
                        await self.release()
                    await self.src.cmd("migrate_cancel")
                elif verdict.decision in (Decision.FORCE, Decision.POSTCOPY):
                    self.events.say(verdict.reason)
            elif cancel_deadline is not None and time.monotonic() > cancel_deadline:
                raise VMError(f"migration still {obs.status} {CANCEL_TIMEOUT_S:.0f}s after "
                              "migrate_cancel")
            # the next period's deadline (a poll woken early, at the first pass's
            # end, keeps the period's own poll)
            tick = int((time.monotonic() - start) / self.period) + 1
            await self._wait_until(start + tick * self.period)

    async def _query(self) -> dict[str, Any]:
        """``query-migrate``. While it goes unanswered (QEMU's main loop held, as in
        stop-and-copy) the switchover watch looks at the final send and yanks a dead
        one (:class:`livemig.engine.stall.SwitchoverWatch`)."""
        watch = self.switchover
        if watch is None or watch.timeout <= 0:
            return dict(await self.src.cmd("query-migrate"))
        task = asyncio.ensure_future(self.src.cmd("query-migrate"))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LOOK_S)
                if done:
                    watch.reset()
                    return dict(task.result())
                if self.yanked is not None:
                    continue
                acked = await asyncio.to_thread(watch.progress)
                reason = watch.feed(time.monotonic(), acked)
                if reason:
                    self.yanked = reason
                    self.events.event("phase yanking: " + reason)
                    self.events.say(f"failing the migration: {reason}")
                    await self._yank()
        finally:
            if not task.done():
                task.cancel()

    async def _yank(self) -> None:
        """QMP ``yank`` out-of-band (it runs without QEMU's main lock): the migration
        sockets are shut down, the blocked send fails, QEMU resumes the source."""
        oob = getattr(self.src, "oob", None)
        if oob is None:
            return
        try:
            await oob("yank", instances=YANK_MIGRATION)
        except VMError as e:
            self.events.event("yank failed", error=str(e))

    async def _postcopy(self, obs: Observation) -> None:
        """In post-copy: the destination resumed (once), and nothing cancels."""
        if self.dst is not None and not self.dst.alive():
            raise VMError(f"destination QEMU is gone ({self.dst.name}) in post-copy: the "
                          "guest is lost with it (the source lacks its newest pages)")
        if obs.status == "postcopy-paused":
            raise VMError("post-copy paused: the migration link failed; the guest waits "
                          "on the destination for pages only the source has (recover "
                          "with QMP migrate-recover on the destination, then migrate "
                          "with resume=true on the source)")
        if (not self.postcopy_done and self.on_postcopy is not None
                and obs.status.startswith("postcopy")):  # QEMU handed the guest over
            self.postcopy_done = await self.on_postcopy()
        stop = ("interrupted" if self.interrupt.is_set() else
                f"--max-time {self.max_time:g}s" if self.max_time and obs.t > self.max_time
                else None)
        if stop and not self.postcopy_noted:
            self.postcopy_noted = True
            self.events.event("stop not possible in post-copy", reason=stop)
            self.events.say(f"{stop}: the migration is in post-copy (the destination runs "
                            "the guest and still pulls pages from the source): it cannot be "
                            "cancelled without losing the guest; it runs to its end")

    async def _decide(self, obs: Observation) -> Verdict:
        """The policies first (they may abort), then the run's own limits."""
        verdict = CONTINUE
        p = self.policies
        if p is not None and p.active and obs.status in POLICY_STATES:
            verdict = await p.tick(obs.snapshot(self.hooks.disk_observation()))
        if verdict.decision is Decision.CANCEL:
            return verdict
        if verdict.decision is Decision.POSTCOPY:
            self.postcopy_asked = obs.t
        if self.postcopy_asked is not None:  # QEMU is switching to post-copy: no cancel
            if obs.t - self.postcopy_asked < POSTCOPY_GRACE_S:
                await self._postcopy(obs)
                return verdict
            self.events.event("post-copy not entered", after_s=round(
                obs.t - self.postcopy_asked, 1))
            self.postcopy_asked = None  # refused: a pre-copy like any other again
        limit = self._limits(obs, "did not converge")
        if limit:
            return Verdict(Decision.CANCEL, limit)
        disk = self.hooks.disk_observation() or {}
        stalled = self.stall.feed(time.monotonic(), obs.status, obs.transferred,
                                  disk.get("remaining"))
        if stalled:
            return Verdict(Decision.CANCEL, stalled)
        self._check_destination()
        return verdict

    async def _disk_first(self, obs: Observation) -> str | None:
        """One tick while the RAM waits for the disk copy: the policies on a disk-only
        snapshot (IO QoS acts during the first pass), the run's limits, then the gate:
        ``migrate`` is issued at the tick the disk observation says ``ready``. The
        reason to stop, or None."""
        disk = self.hooks.disk_observation()
        p = self.policies
        if p is not None and p.active:
            verdict = await p.tick(obs.snapshot(disk))
            if verdict.decision is Decision.CANCEL:  # a policy gave up on the disk copy
                return verdict.reason
        limit = self._limits(obs, "disk copy not done")
        if limit:
            return limit
        # a dead link stops the copy: the bytes copied stand still (the remainder may
        # still grow with the guest's writes)
        copied = (int(disk["total"]) - int(disk["remaining"])
                  if disk and "total" in disk and "remaining" in disk else None)
        stalled = self.stall.feed(time.monotonic(), obs.status, copied)
        if stalled:
            return stalled
        self._check_destination()
        start = self.start_ram
        if disk and disk.get("ready") and start is not None:
            self.start_ram = None  # from the next tick on: the migration's own loop
            await start()
        return None

    def _limits(self, obs: Observation, what: str) -> str | None:
        """Ctrl-C and ``--max-time``: why to stop, or None."""
        if self.interrupt.is_set():
            return "interrupted"
        if self.max_time and obs.t > self.max_time:
            return f"{what} within --max-time {self.max_time:g}s"
        return None

    def _check_destination(self) -> None:
        """A destination that died fails the migration."""
        dead = self.hooks.destination_dead()
        if dead:
            raise VMError(dead)
        if self.dst is not None and not self.dst.alive():
            raise VMError(f"destination QEMU is gone ({self.dst.name})")

    async def _wait_until(self, deadline: float) -> None:
        """Sleep until the absolute ``deadline``, a MIGRATION status event, or the
        end of the first pass (``MIGRATION_PASS`` 2: the policies that act on it, such
        as the codec switch of zstd+delta, act at once instead of at the next poll)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ev = await self.src.next_event(left)
            if ev is None:
                return
            name = ev.get("event")
            if name == "MIGRATION_PASS":
                self.passes = int(ev.get("data", {}).get("pass", self.passes + 1))
                if not ev.get("recorded"):  # libvirt's job records its own
                    self.events.event("round", round=self.passes)
                if self.passes == FIRST_PASS_OVER:
                    return
            elif name == "MIGRATION":
                return
