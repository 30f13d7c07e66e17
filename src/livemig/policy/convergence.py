"""Downtime ramp and the last resort.

``DowntimeRamp``: while rounds do not shrink, raise ``downtime-limit`` step by step
(×``FACTOR`` per stalled round) up to ``max-downtime``: a migration that is 'almost
there' switches over with a slightly longer pause instead of never.

``LastResort``: when the strategy is exhausted, force the switchover (the pause is
then as long as the remainder takes; the user is told), abort keeping the source
running, or switch to post-copy.

``PostcopyAfter``: switch to post-copy once pre-copy has run a set time without
completing (KubeVirt's ``completionTimeoutPerGiB`` with ``allowPostCopy``, per
migration): a bound on how long the migration holds the source, whatever the guest
does, at the price of a destination that runs before it has all of its RAM.
"""

from __future__ import annotations

from livemig.policy.base import (
    AbortMigration,
    Action,
    ForceSwitchover,
    RoundTracker,
    SetDowntimeLimit,
    Snapshot,
    StartPostcopy,
    StrategyExhausted,
)

FACTOR = 1.5
FORCE_DOWNTIME_MS = 60_000  # "whatever it takes": the remainder at link speed
ON_STALL = ("force", "abort", "postcopy")


class DowntimeRamp:
    name = "downtime-ramp"

    def __init__(self, start_ms: int = 300, max_ms: int = 1000) -> None:
        self.limit = start_ms
        self.max_ms = max_ms
        self.rounds = RoundTracker()

    def decide(self, s: Snapshot) -> list[Action]:
        if not self.rounds.update(s) or not self.rounds.stalled() or self.limit >= self.max_ms:
            return []
        self.limit = min(self.max_ms, round(self.limit * FACTOR))
        return [SetDowntimeLimit(f"rounds not shrinking: downtime-limit -> {self.limit} ms",
                                 self.limit)]


class PostcopyAfter:
    name = "postcopy-after"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.fired = False

    def decide(self, s: Snapshot) -> list[Action]:
        if self.fired or s.t < self.seconds:
            return []
        self.fired = True
        return [StartPostcopy(f"switching to post-copy: pre-copy ran {s.t:.1f} s "
                              f"(postcopy-after {self.seconds:g} s), {s.remaining} B left")]


class LastResort:
    name = "last-resort"

    def __init__(self, on_stall: str = "force") -> None:
        if on_stall not in ON_STALL:
            raise ValueError(f"on-stall must be one of {ON_STALL}")
        self.on_stall = on_stall
        self.fired = False

    def react(self, exhausted: StrategyExhausted, s: Snapshot) -> list[Action]:
        if self.fired:
            return []
        self.fired = True
        why = f"{exhausted.reason}; remaining {s.remaining} B"
        if self.on_stall == "force":
            return [ForceSwitchover(f"forcing switchover: {why}"),
                    SetDowntimeLimit("force: accept any downtime", FORCE_DOWNTIME_MS)]
        if self.on_stall == "abort":
            return [AbortMigration(f"aborting, source keeps running: {why}")]
        return [StartPostcopy(f"switching to post-copy: {why}")]
