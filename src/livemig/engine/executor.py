"""The policy executor: one for every entry point (lab, attach, libvirt).

Every poll: the configured policies decide on the snapshot, the last resort reacts
when the strategy is exhausted, every action is recorded with its reason and carried
out through the caller's :class:`~livemig.engine.actuator.Actuator`, the throttle's
lease is renewed when no action set it, and the actions amount to a verdict for the
monitor (cancel, post-copy started, forced switchover, continue). ``release()`` at
the end, whatever the outcome: no throttle and no IO cap survive the migration.

Which policies run is decided once, from the livemig settings (:class:`PolicyConfig`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from livemig.engine.actuator import Actuator, NotApplied
from livemig.engine.decision import CONTINUE, Decision, Verdict
from livemig.policy.base import (
    AbortMigration,
    Action,
    ForceSwitchover,
    Policy,
    SetCompression,
    SetDowntimeLimit,
    SetIoThrottle,
    SetMirrorSpeed,
    SetRamBandwidth,
    SetSwitchoverBandwidth,
    SetThrottle,
    Snapshot,
    StartPostcopy,
    StrategyExhausted,
)
from livemig.policy.converge import ConvergeThrottle
from livemig.policy.convergence import (
    AfterFirstPass,
    DowntimeRamp,
    LastResort,
    PostcopyAfter,
    SwitchoverBandwidth,
)
from livemig.policy.disk import IoQos, LinkShare
from livemig.policy.throttle import ThrottlePolicy

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

# The patched throttle is a lease: it lapses unless renewed. Polls come every 0.25 s
# (poll-interval), so four may be missed before a lost livemig stops throttling.
THROTTLE_LEASE_MS = 1000
# livemig's own throttles (the patched set-cpu-throttle); the others are QEMU's
POLICY_THROTTLES = ("reference", "direct", "staged", "converge")

# the QEMU parameter the switchover-bandwidth policy sets (QEMU 8.2 on)
SWITCHOVER_BW = "avail-switchover-bandwidth"

Record = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class PolicyConfig:
    """Which policies run, from the livemig settings and what the caller knows."""

    throttle: str = "off"
    downtime_ms: int = 300  # the downtime limit the migration starts with
    downtime_ramp: bool = False
    max_downtime: int = 1000
    switchover_bandwidth: bool = False  # set QEMU's avail-switchover-bandwidth
    on_stall: str = "force"
    postcopy_after: float = 0.0  # seconds of pre-copy, then post-copy (0: never)
    disk_copy: bool = False  # the caller copies the disk (the disk policies may run)
    disk_link: float | None = None  # bytes/s the copy and RAM share (None: not shared)
    disk_schedule: str = "libvirt"  # first: LinkShare splits the link after the first pass
    io_qos: bool = False
    ram_cap: int | None = None  # an explicit --bandwidth, never exceeded

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], downtime_ms: int,
                      disk_link: float | None = None,
                      ram_cap: int | None = None) -> PolicyConfig:
        """From converted livemig settings (``Plan.livemig_settings()``); the disk
        policies run when the caller shares a link with its disk copy."""
        return cls(throttle=str(settings.get("throttle", "off")), downtime_ms=downtime_ms,
                   downtime_ramp=bool(settings.get("downtime-ramp", False)),
                   max_downtime=int(settings.get("max-downtime", 1000)),
                   switchover_bandwidth=bool(settings.get("switchover-bandwidth", False)),
                   on_stall=str(settings.get("on-stall", "force")),
                   postcopy_after=float(settings.get("postcopy-after", 0.0)),
                   disk_copy=disk_link is not None, disk_link=disk_link,
                   disk_schedule=str(settings.get("disk-schedule", "libvirt")),
                   io_qos=bool(settings.get("io-qos", False)), ram_cap=ram_cap)


class PolicyExecutor:
    """Runs the policies of ``cfg`` and acts through ``actuator``; ``record(what,
    data)`` gets every action with its reason and every refusal."""

    def __init__(self, cfg: PolicyConfig, actuator: Actuator, record: Record,
                 lease_ms: int = THROTTLE_LEASE_MS) -> None:
        self.actuator = actuator
        self.record = record
        self.lease_ms = lease_ms
        self.policies: list[Policy] = []
        self.converge: ConvergeThrottle | None = None
        if cfg.throttle == "converge":
            self.converge = ConvergeThrottle(cfg.downtime_ms)
            self.policies.append(self.converge)
        elif cfg.throttle in POLICY_THROTTLES:
            self.policies.append(ThrottlePolicy(cfg.throttle))
        if cfg.downtime_ramp:
            self.policies.append(DowntimeRamp(cfg.downtime_ms, cfg.max_downtime))
        if cfg.switchover_bandwidth:
            conv = self.converge
            self.policies.append(SwitchoverBandwidth(
                cfg.ram_cap, full=(lambda s: conv.full_budget) if conv is not None else None))
        if cfg.disk_copy and cfg.disk_link is not None and cfg.disk_schedule == "first":
            self.policies.append(LinkShare(cfg.disk_link, cfg.ram_cap))
        if cfg.disk_copy and cfg.io_qos:
            self.policies.append(IoQos())
        if cfg.postcopy_after > 0:
            self.policies.append(PostcopyAfter(cfg.postcopy_after))
        self.last_resort = LastResort(cfg.on_stall)
        self.throttle_pct = 0
        self.io_cap = 0
        self.switchover_bw = 0
        self.switchover_guest = False  # switchover_bw is a guest-byte rate

    @property
    def active(self) -> bool:
        return bool(self.policies)


    def after_first_pass(self, encoding: Mapping[str, Any] | None) -> None:
        """The encoding chosen (the report's ``encoding``) switches codec once the first
        pass is over (``after_first_pass``): from the next poll on, a policy does it.
        Called when the choice is known: before the migration, or by the deferred
        choice while it runs."""
        then = (encoding or {}).get("after_first_pass") or {}
        method = then.get("multifd-compression")
        if method and not any(isinstance(p, AfterFirstPass) for p in self.policies):
            self.policies.append(AfterFirstPass(str(method)))
            if self.converge is not None:
                self.converge.expect_codec_switch()

    async def tick(self, s: Snapshot) -> Verdict:
        """Run every policy on ``s``, carry out what they decide, renew the throttle's
        lease, and say what the monitor does next."""
        actions: list[Action] = []
        for p in self.policies:
            actions += p.decide(s)
        for a in list(actions):
            if isinstance(a, StrategyExhausted):
                actions += self.last_resort.react(a, s)
        for a in actions:
            await self.apply(a)
        if self.throttle_pct and not any(isinstance(a, SetThrottle) for a in actions):
            await self._act("renew throttle", self.actuator.set_throttle(
                self.throttle_pct, self.lease_ms))
        return verdict(actions)

    async def apply(self, a: Action) -> bool:
        """Carry out one action; False when its end refused a codec switch (the
        refusal is recorded; other refusals are too, and change nothing here)."""
        log.info("policy action %s", a)
        self.record(f"action {type(a).__name__}", asdict(a))
        name = type(a).__name__
        act = self.actuator
        if isinstance(a, SetThrottle):
            self.throttle_pct = a.percent
            await self._act(name, act.set_throttle(a.percent, self.lease_ms))
        elif isinstance(a, SetDowntimeLimit):
            if self.converge is not None:
                self.converge.set_downtime(a.ms)
            await self._act(name, act.set_downtime(a.ms))
        elif isinstance(a, StartPostcopy):
            await self._act(name, act.start_postcopy())
        elif isinstance(a, SetSwitchoverBandwidth):
            await self._switchover_bandwidth(name, a.bytes_per_s, a.guest_bytes)
        elif isinstance(a, SetCompression):
            done = await self._act(name, act.set_compression(a.method, a.delta_cache))
            if self.converge is not None:
                if done:
                    self.converge.codec_switched()
                else:
                    self.converge.codec_refused()
            return done
        elif isinstance(a, SetRamBandwidth):
            await self._act(name, act.set_ram_bandwidth(a.bytes_per_s))
            if 0 < a.bytes_per_s < self.switchover_bw and not self.switchover_guest:
                # the stream may not go faster (a guest-byte rate is the policy's to lower)
                await self._switchover_bandwidth("lower switchover bandwidth", a.bytes_per_s)
        elif isinstance(a, SetMirrorSpeed):
            await self._act(name, act.set_mirror_speed(a.bytes_per_s))
        elif isinstance(a, SetIoThrottle):
            self.io_cap = a.write_bytes_per_s
            await self._act(name, act.set_io_throttle(a.write_bytes_per_s))
        # AbortMigration, ForceSwitchover, StrategyExhausted: the verdict carries them
        return True

    async def _switchover_bandwidth(self, what: str, bytes_per_s: int,
                                    guest_bytes: bool = False) -> None:
        if await self._act(what, self.actuator.set_switchover_bandwidth(bytes_per_s)):
            self.switchover_bw, self.switchover_guest = bytes_per_s, guest_bytes
            if self.converge is not None:
                self.converge.set_switchover_bandwidth(bytes_per_s, guest_bytes)

    async def _act(self, what: str, call: Awaitable[None]) -> bool:
        """Await one actuator call; a refusal is recorded, not a failure of the run
        (the migration may have ended since the last poll)."""
        try:
            await call
        except NotApplied as e:
            log.info("%s not applied: %s", what, e)
            self.record("action not applied", {"action": what, "error": str(e)})
            return False
        return True

    async def release(self) -> None:
        """At the end, whatever the outcome: no throttle, no cap on guest writes (QEMU
        drops the throttle itself when the migration ends; the IO cap would stay on
        a source that runs on)."""
        if self.throttle_pct:
            self.throttle_pct = 0
            await self._act("release throttle", self.actuator.set_throttle(0, self.lease_ms))
        if self.io_cap:
            self.io_cap = 0
            self.record("io cap removed", {})
            await self._act("release io cap", self.actuator.set_io_throttle(0))


def verdict(actions: list[Action]) -> Verdict:
    """The decision a tick's actions amount to (the first one that decides wins)."""
    for a in actions:
        if isinstance(a, AbortMigration):
            return Verdict(Decision.CANCEL, a.reason)
        if isinstance(a, StartPostcopy):
            return Verdict(Decision.POSTCOPY, a.reason)
        if isinstance(a, ForceSwitchover):
            return Verdict(Decision.FORCE, a.reason)
    return CONTINUE
