"""A throttle that converges in one more round with the least guest work lost.

Physics, per round k (a pass over the dirty bitmap, bounded by MIGRATION_PASS /
``dirty-sync-count``):

- the stream drains guest pages at ``B`` bytes/s (page rate: pages per second ×
  page size, not wire bytes, so compression counts in B's favour);
- round k started with ``R_k`` bytes dirty, so it lasts ``T_k ≈ R_k / B``;
- the guest dirtied ``R_k`` distinct bytes during round k-1, which lasted
  ``T_{k-1}``: its *distinct* dirty rate is ``d = R_k / T_{k-1}``. This already
  includes a hot set's saturation (rewriting the same pages adds nothing), which the
  raw dirty-page rate QEMU reports does not;
- a throttle θ scales the vCPUs' progress, hence d, by ``(1-θ) / (1-θ_now)``;
- QEMU switches over when what is left fits the downtime limit: ``R ≤ B × T_d``.

So the next round ends with ``R_{k+1} ≈ d × (1-θ)/(1-θ_now) × T_k`` and it converges
when that is ≤ ``SAFETY × B × T_d``:

    θ = 1 − SAFETY × B² × T_d × (1−θ_now) / (d × R_k)

Work lost is about θ × T_k: one round at the smallest θ that converges, instead of
auto-converge's ladder (20 %, 30 %, ... one round each, every round costing work and
re-sent bytes). Nothing is done while rounds shrink fast enough on their own (the
projected remainder of the round after next fits) or when the remainder already
fits. When θ would exceed ``DEEP`` (the guest below 10 % of normal) for longer than
``DEEP_MAX_S``, the throttle holds at ``DEEP`` for that long and recomputes at the
next round: deep throttling for long is what stock auto-converge avoids and what the
harm figures count. ``MAX_PCT`` held for ``HOLD_ROUNDS`` rounds whose remainder did
not shrink by ``STALL`` exhausts the strategy (the last resort decides: force,
abort, post-copy); rounds at the maximum that still shrink are left to run.
"""

from __future__ import annotations

from livemig.policy.base import (
    Action,
    Ewma,
    SetThrottle,
    Snapshot,
    StrategyExhausted,
)

SAFETY = 0.8  # aim the next remainder at 80 % of what the downtime limit allows
DEEP = 90  # % above which the guest runs below 10 % of normal
DEEP_MAX_S = 3.0  # at most this long at a time below 10 % (the harm target's floor)
MAX_PCT = 99
HOLD_ROUNDS = 2
SHRINK_OK = 0.5  # a round that halves the remainder needs no help yet
STALL = 0.95  # a round whose remainder is above 95 % of the last one's made no progress


class ConvergeThrottle:
    name = "throttle-converge"

    def __init__(self, downtime_ms: int) -> None:
        self.downtime_s = downtime_ms / 1000.0
        self.rate = Ewma(0.5)
        self.percent = 0
        self.exhausted = False
        self._round = -1
        self._round_t = 0.0
        self._prev: tuple[float, int] | None = None  # (duration of last round, R at its start)
        self._at_max = 0

    def set_downtime(self, ms: int) -> None:
        """The downtime ramp raised the limit: aim at the new one."""
        self.downtime_s = ms / 1000.0

    def decide(self, s: Snapshot) -> list[Action]:
        b = self.rate.add(s.page_rate or s.bandwidth)
        if s.rounds <= self._round:
            return []
        started, last_t = self._round >= 0, self._round_t
        self._round, self._round_t = s.rounds, s.t
        if self.exhausted or s.rounds < 2 or not started or b <= 0:
            self._prev = (s.t - last_t, s.remaining) if started else None
            return []
        prev_len = s.t - last_t
        prev = self._prev
        self._prev = (prev_len, s.remaining)
        return self._round_start(s, b, prev_len, prev)

    def _round_start(self, s: Snapshot, b: float, prev_len: float,
                     prev: tuple[float, int] | None) -> list[Action]:
        r = s.remaining
        budget = b * self.downtime_s
        if r <= budget or prev_len <= 0:
            return []
        if prev is not None and prev[1] > 0 and r <= SHRINK_OK * prev[1] and not self.percent:
            return []  # converging by itself
        d = r / prev_len  # distinct bytes dirtied per second in the last round
        now = self.percent / 100.0
        need = 1.0 - SAFETY * b * b * self.downtime_s * (1.0 - now) / (d * r)
        pct = max(self.percent, min(MAX_PCT, round(100.0 * need + 0.5)))
        t_round = r / b
        why = (f"round {s.rounds}: {r >> 20} MiB dirty (distinct rate {d / 2**20:.0f} MiB/s, "
               f"drained at {b / 2**20:.0f} MiB/s, downtime budget {budget / 2**20:.1f} MiB)")
        if pct > DEEP and t_round > DEEP_MAX_S and self.percent < DEEP:
            pct = DEEP  # the round would keep the guest below 10 % too long: shrink R first
            why += f"; needs more than {DEEP}% for {t_round:.1f}s: {DEEP}% this round"
        stalled = prev is not None and r >= STALL * prev[1]
        if pct >= MAX_PCT and self.percent >= MAX_PCT and stalled:
            self._at_max += 1
            if self._at_max > HOLD_ROUNDS:
                self.exhausted = True
                return [StrategyExhausted(f"throttle held {MAX_PCT}% for {HOLD_ROUNDS} "
                                          f"rounds without converging")]
        if pct == self.percent:
            return []
        self.percent = pct
        return [SetThrottle(f"{why} -> {pct}% to fit the next remainder", pct)]
