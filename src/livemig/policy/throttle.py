"""CPU throttling that acts decisively (the reference design's item 6).

Trigger: two consecutive rounds found about the same amount dirty (< 5 % apart, or
more): pre-copy alone is not converging.

- ``direct``: the remainder would go in under ``DIRECT_HORIZON_S`` of bandwidth if
  only the guest held still, so hold it still briefly: 90 % for 3 s, then 99 % for
  3 s. The switchover normally happens inside the first window.
- ``staged``: the guest dirties far more than the link carries. Each round, aim the
  guest's dirty rate at ``TARGET_SHARE`` (20 %) of the bandwidth. The reference
  writes the ratio as "1 − (avg_bandwidth × 0.2 / dirty_rate × previous_ratio)";
  read literally that *weakens* the throttle as it grows, the opposite of the
  intent ("progressively stronger"). The reading implemented here accounts for the
  observed dirty rate already being reduced by the previous throttle: the guest's
  unthrottled rate is ``observed / (1 − prev)``, so

      ratio = 1 − (0.2 × avg_bandwidth / observed_dirty_rate) × (1 − prev)

  and, while rounds still do not shrink, never less than ``prev + MIN_STEP``.
  Capped at 99 %; held there ``HOLD_AT_MAX_S`` seconds.
- ``reference``: the reference's choice between the two on each trigger.

When the strategy has done everything, it returns ``StrategyExhausted`` and the
last-resort policy (force switchover, abort or post-copy) takes over.
"""

from __future__ import annotations

import logging

from livemig.policy.base import (
    Action,
    Ewma,
    RoundTracker,
    SetThrottle,
    Snapshot,
    StrategyExhausted,
)

log = logging.getLogger(__name__)

DIRECT_HORIZON_S = 5.0
DIRECT_STEPS: tuple[tuple[int, float], ...] = ((90, 3.0), (99, 3.0))
TARGET_SHARE = 0.2
MIN_STEP = 10
MAX_PCT = 99
HOLD_AT_MAX_S = 3.0
MODES = ("reference", "direct", "staged")


def staged_ratio(bandwidth: float, observed_dirty: float, prev_pct: int) -> int:
    """The staged throttle percentage for the next round (see module doc)."""
    if observed_dirty <= 0:
        return prev_pct
    prev = prev_pct / 100.0
    ratio = 1.0 - (TARGET_SHARE * bandwidth / observed_dirty) * (1.0 - prev)
    return max(0, min(MAX_PCT, round(ratio * 100)))


class ThrottlePolicy:
    name = "throttle"

    def __init__(self, mode: str = "reference") -> None:
        if mode not in MODES:
            raise ValueError(f"throttle mode must be one of {MODES}")
        self.mode = mode
        self.rounds = RoundTracker()
        self.bandwidth = Ewma()
        self.state = "watching"  # watching | direct | staged | exhausted
        self.percent = 0
        self._step = 0
        self._step_until = 0.0
        self._max_since: float | None = None

    def decide(self, s: Snapshot) -> list[Action]:
        bw = self.bandwidth.add(s.bandwidth)
        new_round = self.rounds.update(s)
        if self.state == "exhausted":
            return []
        if self.state == "watching":
            if not (new_round and self.rounds.stalled()):
                return []
            direct = s.remaining < bw * DIRECT_HORIZON_S
            if self.mode == "direct" or (self.mode == "reference" and direct):
                return self._start_direct(s, bw)
            self.state = "staged"
            return self._stage(s, bw, why="stalled: dirty amount not shrinking")
        if self.state == "direct":
            return self._direct_tick(s)
        return self._staged_tick(s, bw, new_round)

    # -- direct -----------------------------------------------------------------------
    def _start_direct(self, s: Snapshot, bw: float) -> list[Action]:
        self.state = "direct"
        self._step = 0
        pct, hold = DIRECT_STEPS[0]
        self._step_until = s.t + hold
        self.percent = pct
        return [SetThrottle(f"direct: remaining {s.remaining} B < {DIRECT_HORIZON_S:g} s of "
                            f"bandwidth {bw:.0f} B/s; hold {pct}% for {hold:g}s", pct)]

    def _direct_tick(self, s: Snapshot) -> list[Action]:
        if s.t < self._step_until:
            return []
        self._step += 1
        if self._step >= len(DIRECT_STEPS):
            self.state = "exhausted"
            return [StrategyExhausted(f"direct throttle at {self.percent}% did not converge")]
        pct, hold = DIRECT_STEPS[self._step]
        self._step_until = s.t + hold
        self.percent = pct
        return [SetThrottle(f"direct: still not done, hold {pct}% for {hold:g}s", pct)]

    # -- staged -----------------------------------------------------------------------
    def _stage(self, s: Snapshot, bw: float, why: str) -> list[Action]:
        pct = staged_ratio(bw, s.dirty_rate, self.percent)
        pct = min(MAX_PCT, max(pct, self.percent + MIN_STEP))
        self.percent = pct
        if pct >= MAX_PCT and self._max_since is None:
            self._max_since = s.t
        return [SetThrottle(f"staged: {why}; dirty {s.dirty_rate:.0f} B/s vs bandwidth "
                            f"{bw:.0f} B/s -> {pct}%", pct)]

    def _staged_tick(self, s: Snapshot, bw: float, new_round: bool) -> list[Action]:
        if self._max_since is not None:
            if s.t - self._max_since >= HOLD_AT_MAX_S:
                self.state = "exhausted"
                return [StrategyExhausted(f"staged throttle held {MAX_PCT}% for "
                                          f"{HOLD_AT_MAX_S:g}s without converging")]
            return []
        if new_round and self.rounds.stalled():
            return self._stage(s, bw, why="round still not shrinking")
        return []
