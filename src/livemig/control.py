"""The controller: runs the configured policies on every poll and carries out their
actions over QMP. Every action is logged with its reason and goes to the timeline.

livemig settings it reads (``--set``):

- ``throttle``: ``off`` | ``auto-converge`` (QEMU's own) | ``reference`` | ``direct``
  | ``staged`` (livemig's, through the patched QEMU's ``set-cpu-throttle``) |
  ``dirty-limit`` (QEMU's per-vCPU dirty limit; KVM with a dirty ring only).
- ``downtime-ramp``: on/off; ``max-downtime``: ceiling in ms.
- ``on-stall``: ``force`` | ``abort`` | ``postcopy`` when the strategy is exhausted.
- with ``--storage copy``: ``disk-schedule`` (``first`` shares the link between the
  mirror and RAM after the disk's first pass; ``libvirt`` and ``concurrent`` let
  them compete, after the first pass or from the start),
  ``io-qos`` (cap guest writes while the disk remainder does not shrink).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import asdict
from typing import Any

from livemig.engine.actuator import DiskTargets
from livemig.engine.decision import CONTINUE, Decision, Verdict
from livemig.errors import UsageError, VMError
from livemig.policy.base import (
    AbortMigration,
    Action,
    ForceSwitchover,
    Policy,
    SetDowntimeLimit,
    SetIoThrottle,
    SetMirrorSpeed,
    SetRamBandwidth,
    SetThrottle,
    Snapshot,
    StartPostcopy,
    StrategyExhausted,
)
from livemig.policy.converge import ConvergeThrottle
from livemig.policy.convergence import DowntimeRamp, LastResort
from livemig.policy.disk import IoQos, LinkShare
from livemig.policy.throttle import ThrottlePolicy

log = logging.getLogger(__name__)

# The patched QEMU's throttle commands (qemu/patches): set-cpu-throttle is a lease,
# renewed every poll (poll-interval 0.25 s: four polls may be missed before it ends);
# cancel-cpu-throttle drops it. Either leaves auto-converge's own throttle alone.
THROTTLE_SET = "set-cpu-throttle"
THROTTLE_CANCEL = "cancel-cpu-throttle"
THROTTLE_LEASE_MS = 1000
THROTTLES = ("off", "auto-converge", "reference", "direct", "staged", "converge",
             "dirty-limit")

Command = Callable[..., Awaitable[Any]]


class Controller:
    def __init__(self, settings: dict[str, Any], qemu_params: dict[str, Any], accel: str,
                 downtime_ms: int, record: Callable[[str, dict[str, Any]], None],
                 disk_link: float | None = None, ram_cap: int | None = None,
                 qemu_commands: Collection[str] = (),
                 disk: DiskTargets | None = None) -> None:
        """``disk_link``: bytes/s of the link when the disk is copied and ``disk`` what
        the disk policies act on (either None: no disk policies); ``ram_cap``: an
        explicit --bandwidth; ``qemu_commands``: the source's QMP commands
        (``query-commands``)."""
        self.record = record
        self.disk = disk
        if disk is None:
            disk_link = None
        self.throttle_mode = str(settings.get("throttle", "off"))
        if self.throttle_mode not in THROTTLES:
            raise UsageError(f"bad --set throttle={self.throttle_mode}: choose from "
                             f"{', '.join(THROTTLES)}")
        if self.throttle_mode == "dirty-limit" and accel != "kvm":
            raise UsageError("throttle=dirty-limit needs KVM with a dirty ring; this run "
                             f"uses {accel} (use reference, staged or auto-converge)")
        self.policies: list[Policy] = []
        self.converge: ConvergeThrottle | None = None
        if self.throttle_mode in ("reference", "direct", "staged", "converge"):
            if THROTTLE_SET not in qemu_commands:
                raise UsageError(f"throttle={self.throttle_mode} needs the patched QEMU's "
                                 f"{THROTTLE_SET} command; this QEMU lacks it")
            if self.throttle_mode == "converge":
                self.converge = ConvergeThrottle(downtime_ms)
                self.policies.append(self.converge)
            else:
                self.policies.append(ThrottlePolicy(self.throttle_mode))
        if settings.get("downtime-ramp"):
            self.policies.append(DowntimeRamp(downtime_ms, int(settings["max-downtime"])))
        if disk_link is not None and settings.get("disk-schedule", "first") == "first":
            self.policies.append(LinkShare(disk_link, ram_cap))
        if disk_link is not None and settings.get("io-qos"):
            self.policies.append(IoQos())
        self.last_resort = LastResort(str(settings.get("on-stall", "force")))
        self.throttle_pct = 0
        self.io_cap = 0

    @property
    def active(self) -> bool:
        return bool(self.policies)

    async def tick(self, s: Snapshot, cmd: Command) -> Verdict:
        """Run every policy on ``s``, apply what they decide, and tell the monitor
        what to do next (cancel, post-copy started, forced switchover, continue)."""
        actions: list[Action] = []
        for p in self.policies:
            actions += p.decide(s)
        for a in list(actions):
            if isinstance(a, StrategyExhausted):
                actions += self.last_resort.react(a, s)
        for a in actions:
            await self.apply(a, cmd)
        if self.throttle_pct and not any(isinstance(a, SetThrottle) for a in actions):
            await self._throttle(cmd, self.throttle_pct)  # renew the lease
        return self.verdict(actions)

    def verdict(self, actions: list[Action]) -> Verdict:
        """The decision this tick's actions amount to (first one wins)."""
        for a in actions:
            if isinstance(a, AbortMigration):
                return Verdict(Decision.CANCEL, a.reason)
            if isinstance(a, StartPostcopy):
                return Verdict(Decision.POSTCOPY, a.reason)
            if isinstance(a, ForceSwitchover):
                return Verdict(Decision.FORCE, a.reason)
        return CONTINUE

    async def _set(self, cmd: Command, **params: Any) -> None:
        """Set parameters; a refusal (the migration may have ended since the last
        poll) is recorded, not a failure of the run."""
        try:
            await cmd("migrate-set-parameters", **params)
        except VMError as e:
            log.info("parameters not set (migration ended?): %s", e)
            self.record("action not applied", {"params": params, "error": str(e)})

    async def _throttle(self, cmd: Command, percent: int) -> None:
        """Set (or renew) the throttle's lease; 0 cancels it. The migration may have
        ended since the last poll, in which case QEMU refuses: not a failure of the
        run (QEMU dropped the throttle itself)."""
        if percent:
            await self._try(cmd, THROTTLE_SET, percent=percent,
                            **{"lease-ms": THROTTLE_LEASE_MS})
        else:
            await self._try(cmd, THROTTLE_CANCEL)

    async def apply(self, a: Action, cmd: Command) -> None:
        log.info("policy action %s", a)
        self.record(f"action {type(a).__name__}", asdict(a))
        if isinstance(a, SetThrottle):
            self.throttle_pct = a.percent
            await self._throttle(cmd, a.percent)
        elif isinstance(a, SetDowntimeLimit):
            if self.converge is not None:
                self.converge.set_downtime(a.ms)
            await self._set(cmd, **{"downtime-limit": a.ms})
        elif isinstance(a, StartPostcopy):
            await cmd("migrate-start-postcopy")
        elif isinstance(a, SetRamBandwidth):
            await self._set(cmd, **{"max-bandwidth": a.bytes_per_s})
        elif isinstance(a, SetMirrorSpeed) and self.disk is not None:
            await self._try(cmd, "block-job-set-speed", device=self.disk.block_job,
                            speed=a.bytes_per_s)
        elif isinstance(a, SetIoThrottle) and self.disk is not None:
            self.io_cap = a.write_bytes_per_s
            await self._io_throttle(cmd, a.write_bytes_per_s)

    async def _io_throttle(self, cmd: Command, write_bps: int) -> None:
        assert self.disk is not None
        await self._try(cmd, "block_set_io_throttle", id=self.disk.io_device, bps=0, bps_rd=0,
                        bps_wr=write_bps, iops=0, iops_rd=0, iops_wr=0)

    async def _try(self, cmd: Command, command: str, **args: Any) -> None:
        try:
            await cmd(command, **args)
        except VMError as e:
            log.info("%s not applied: %s", command, e)
            self.record("action not applied", {"command": command, "error": str(e)})

    async def release(self, cmd: Command) -> None:
        """At the end, whatever the outcome: no throttle, no cap on guest writes (QEMU
        clears the throttle itself; the IO cap would stay on a source that runs on)."""
        if self.throttle_pct:
            self.throttle_pct = 0
            await self._throttle(cmd, 0)
        if self.io_cap:
            self.io_cap = 0
            self.record("io cap removed", {})
            await self._io_throttle(cmd, 0)
