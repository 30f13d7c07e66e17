"""A throttle that converges with the least guest work lost: depth and rounds chosen together.

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
- QEMU switches over when what is left fits the downtime limit: ``R ≤ W × T_d``,
  where ``W`` is the stream's *wire* rate (QEMU's ``threshold_size`` is the bytes it
  transferred per second × the limit, the same figure as ``mbps``). Under compression
  W < B, so the budget in guest bytes is smaller than the page rate suggests: a budget
  of B × T_d (tried) reads a remainder QEMU will not switch over with as converged.

So a round ends with ``R_{k+1} ≈ q × R_k``, where ``q = d × (1-θ)/(1-θ_now) / B``,
and it converges when the remainder is ≤ ``SAFETY × W × T_d``. A plan of ``n`` more
rounds at one throttle needs ``q_n = (SAFETY × W × T_d / R_k)^(1/n)``, i.e.

    θ_n = 1 − q_n × B × (1−θ_now) / d        (0 when the guest is slow enough already)

and costs the guest ``θ_n × T(n)`` seconds of work, ``T(n) = R_k/B × (1 + q_n + ... +
q_n^(n-1))`` being the rounds' length. Every plan from one round (the deepest
throttle, the shortest migration) to ``MAX_ROUNDS`` rounds (the lightest), and no
throttle at all for rounds that shrink on their own (up to ``MAX_FREE_ROUNDS``), is
weighed by the work it loses plus ``TIME_COST`` for every second it keeps the migration going
(the guest shares the host with the migration's threads: in the unthrottled rounds of
the recorded matrix runs it ran at 74-100 % of normal, busy writers with compression
on 2 cores the lowest), and the cheapest one is taken. A guest whose rounds shrink on
their own (``q < 1`` at θ = 0) is left alone when a few more rounds cost less than
throttling it; one that outruns the link gets the one deep round. The distinct rate is
taken as at most QEMU's own dirty-page rate: round lengths are seen at the poll's
granularity, and a short round would otherwise read as a guest dirtying faster than it
writes. The rates alone can promise a shrink the rounds do not deliver (QEMU also syncs
mid-pass, and a saturated hot set dirties as much in a short round as in a long one),
so ``q`` at θ = 0 is the larger of the rates' ``d / B`` and the observed ``R_k /
R_{k-1}`` of the slower of the last two rounds, each scaled to θ = 0 by the
throttle it ran under. At the first decision there is no
observed shrink, only the first pass's rates, the least sure of all (a slow start,
host noise): a guest they say may shrink by itself is left unthrottled
for one more round, and throttled only if the rounds then stop shrinking. Only a
guest that outran even the fastest drain the first pass showed is throttled at once
(per-poll drain rates spread widely on a busy host: 21-87 MB/s within one recorded
pass, whose smoothed rate made a guest that converged alone look unconvergeable).
The rates model a throttle as slowing the dirtying in proportion, which holds
while a round is shorter than the guest takes to fill what it rewrites. A set it
fills faster (a busy database rewriting ~250 MiB within half a second) leaves as
much after a short round as after a long one, and a light throttle spread over
rounds does not shrink it: the rounds went 343, 306, 261, 243 MiB, unthrottled or
(in other runs) at 16-19 % over 12 rounds, before one round at 96 % ended them
(docs/results/libvirt-2026-11-28e, set b). So from
the fourth round on, when a re-send round took at most ``SHORTER`` of the one
before yet its remainder shrank by ``SATURATED_BY`` less than the round did, the
plan is the one deep round.
When the re-sent pages go in another codec than the first pass (``zstd+delta``:
whole zstd pages, then lz4 deltas), the pass's drain says nothing of theirs, so the
first decision waits a round in the new codec whatever the pass showed, and the drain
rates start again at the switch.

The budget's rate: QEMU compares the remainder, in guest bytes, with the rate it
is given (``avail-switchover-bandwidth``, :class:`~livemig.policy.convergence.
SwitchoverBandwidth`) × the limit. At the wire rate a compressed stream switches
over with a remainder the compression ratio smaller than the limit allows (lz4
deltas of 128-byte rows: 15 ms pauses at a 1000 ms limit, after 3.4 s below 10 %
of normal, docs/results/handstarted-2026-11-29e/slowdb), and every round until
then is one the throttle holds the guest through. So once a plan needs the guest
at :data:`FULL_AT` of its speed or less (or holds it there), the budget is the
drain's: ``B × T_d``, and :class:`SwitchoverBandwidth` tells QEMU the rate guest
pages drained at (``full_budget``, kept from then on). The switchover's pause
then takes up to the limit the user accepted, once, in place of throttled
rounds that cost the guest at least half of every second. A guest left unthrottled
keeps the wire budget: another free round costs it little, and its pause stays as
short as stock QEMU's.

A throttle is not a smooth slowdown: QEMU runs the vCPU for a 10 ms slice
(``CPU_THROTTLE_TIMESLICE_NS``) and then sleeps it ``θ/(1-θ)`` slices: at 99 % the
guest is frozen for 990 ms at a time (measured: a 1000 ms gap in the guest's heartbeat
at 99 % where QEMU's own downtime was 16 ms). The throttle is therefore capped where
one sleep would exceed the downtime limit, the pause the user accepted for the
switchover itself: ``θ ≤ L / (L + 10 ms)`` (96 % at 300 ms, 99 % from 990 ms).

When θ would exceed ``DEEP`` (the guest below 10 % of normal) for longer than
``DEEP_MAX_S``, the throttle holds at a cap for that long and recomputes at the
next round: deep throttling for long is what stock auto-converge avoids and what the
harm figures count. The cap must leave the guest above a tenth of its speed in every
stretch of its time the harm figures judge (``WINDOW_S``, 100 ms: the guest agent's
report period), not on average. A throttle runs the vCPU in ``SLICE_S`` slices, one
every ``SLICE_S / (1−θ)``: at 90 % a window holds one slice, 10 % of normal on an idle
host and less on a busy one, where the vCPUs also wait in the run queue for part of
the slice. The capped 90 % round of a busy database through libvirt counted as below
10 % for as long as it ran (3.5 s, docs/results/slow-link-2026-11-30b); capped at 89 %
it did the same (3.2-3.6 s), its vCPUs getting 83-98 % of the CPU they asked for
(``vcpu_share``: the kernel's per-thread run and run-queue wait,
:mod:`livemig.engine.vcpushare`). So the cap is the deepest θ whose windows each
hold ``n`` whole slices with ``n × share > 1`` (:func:`deep_pct`): 80 % with the
vCPUs uncontended or the share unknown (20 % of normal in every window), 70 % once
they get half the CPU they ask for or less, never below ``MIN_DEEP`` (a host that
busy leaves the guest little to lose, and the round must still shrink).
``MAX_PCT`` held for ``HOLD_ROUNDS`` rounds whose remainder did
not shrink by ``STALL`` exhausts the strategy (the last resort decides: force,
abort, post-copy); rounds at the maximum that still shrink are left to run.
"""

from __future__ import annotations

import math

from livemig.policy.base import (
    Action,
    Ewma,
    SetCompression,
    SetThrottle,
    Snapshot,
    StrategyExhausted,
)
from livemig.policy.convergence import FULL_AT as FULL_AT_PCT

SAFETY = 0.8  # aim the next remainder at 80 % of what the downtime limit allows
DEEP = 90  # % above which the guest runs below 10 % of normal
MIN_DEEP = 50  # the shallowest the long round's cap goes on a busy host (see above)
WINDOW_S = 0.1  # the harm figures' window (metrics.BIN_S), which the cap keeps above 10 %
DEEP_MAX_S = 3.0  # at most this long at a time below 10 % (the harm target's floor)
MAX_PCT = 99
SLICE_S = 0.010  # QEMU's CPU_THROTTLE_TIMESLICE_NS: a throttled vCPU sleeps in these
HOLD_ROUNDS = 2
MAX_ROUNDS = 12  # the longest throttled plan weighed (the lightest throttle)
MAX_FREE_ROUNDS = 30  # an unthrottled guest that shrinks is left to run this many rounds
TIME_COST = 0.05  # guest work lost per second of migration, unthrottled (see above)
STALL = 0.95  # a round whose remainder is above 95 % of the last one's made no progress
# a re-send round at most this share of the one before, whose remainder shrank by
# SATURATED_BY less than the round did, shows a saturated set (see the module's text)
SHORTER = 0.8
SATURATED_BY = 0.15
FULL_AT = FULL_AT_PCT / 100  # a throttle from which the budget is the drain's (see above)


class ConvergeThrottle:
    name = "throttle-converge"

    def __init__(self, downtime_ms: int) -> None:
        self.downtime_s = downtime_ms / 1000.0
        self.rate = Ewma(0.5)  # B: guest bytes drained per second
        self.wire = Ewma(0.5)  # W: bytes on the wire per second (QEMU's threshold)
        self.percent = 0
        self.exhausted = False
        self._round = -1
        self._round_t = 0.0
        self._prev: tuple[float, int] | None = None  # (duration of last round, R at its start)
        self._ratio = 0.0  # R_k / R_{k-1} seen at the last round's start, as unthrottled
        self._at_max = 0
        self._peak = 0.0  # the fastest drain seen so far (bytes/s)
        self.switchover_w = 0.0  # avail-switchover-bandwidth once set: QEMU's W
        # the re-sent pages will go in another codec than the first pass (an encoding
        # switched after it, ``zstd+delta``): the pass's drain says nothing of theirs
        self._switch_pending = False
        # the switchover budget asked for: the drain's rate (guest bytes) × the limit,
        # not the wire's (see the module's text); read by SwitchoverBandwidth
        self.full_budget = False
        self.share = Ewma(0.5)  # the vCPUs' share of the CPU they ask for (0: unknown)
        # (codec, new cache's bytes or 0, why): a codec that sends re-sent pages as
        # deltas, tried once before the first throttle (arm_delta_fallback); then the
        # rounds it needs are measured before any throttle
        self._fallback: tuple[str, int, str] | None = None
        self._measure_rounds = 0

    def arm_delta_fallback(self, method: str, why: str, delta_cache: int = 0) -> None:
        """A whole-page codec was chosen, and the guest may turn into a small writer
        (:func:`livemig.policy.encoding.delta_fallback`): the first time this policy
        would throttle, it switches the codec to ``method`` (lz4: re-sent pages as
        deltas) instead and measures its rounds before any throttle: one when the
        stream kept its delta cache, two when it makes a new one (``delta_cache``
        bytes; its first round's pages miss it and go whole).
        A guest that started writing 128 B records flat out a few seconds into its
        migration (1 GiB, 20 MiB/s) was held at 97-99 % for 5-7 s with zstd's whole
        pages; a round of deltas drained ~3× the guest bytes per second, and one
        throttle of 72-75 % ended it (docs/results/late-busy-2026-12-01). A guest that
        turned to whole-page rewrites instead loses those rounds before its throttle,
        and its re-sent pages go in lz4 (zstd-1's ratio is ~1.2× lz4's on mixed
        data)."""
        self._fallback = (method, delta_cache, why)

    def expect_codec_switch(self) -> None:
        """The codec changes when the first pass is over: the first decision then
        waits for one round in the new codec instead of judging it by the pass (whole
        zstd pages drained at 46 MiB/s where the lz4 deltas after them drained at
        hundreds)."""
        self._switch_pending = True

    def codec_switched(self) -> None:
        """The stream now sends in the new codec: the drain rates seen so far were the
        old one's (the wire's rate is the link's and stays)."""
        self.rate = Ewma(0.5)
        self._peak = 0.0

    def deltas_started(self, new_cache: bool) -> None:
        """The stream went to lz4 deltas by another's decision (a second look at the
        guest's pages, :mod:`livemig.engine.second_look`): the fallback is moot, and
        the rounds in the new codec are measured before any throttle, two with a new
        cache (its first round's pages miss it and go whole)."""
        self._fallback = None
        self._measure_rounds = 2 if new_cache else 1

    def codec_refused(self) -> None:
        """QEMU refused the fallback's switch (a build without patch 0019 does not make
        a dropped delta cache again): the next round is judged, and throttled if it
        must be, as if there had been no fallback."""
        self._measure_rounds = 0

    def set_switchover_bandwidth(self, bytes_per_s: int, guest_bytes: bool = False) -> None:
        """QEMU's switchover decision now uses this rate, not its estimate: so does the
        budget. A guest-byte rate (the full budget this policy asked for) is the
        drain's, which the budget takes from the drain itself: the wire rate stays."""
        if not guest_bytes:
            self.switchover_w = float(bytes_per_s)

    def set_downtime(self, ms: int) -> None:
        """The downtime ramp raised the limit: aim at the new one."""
        self.downtime_s = ms / 1000.0

    @property
    def max_pct(self) -> int:
        """The deepest throttle whose sleeps are no longer than the downtime limit."""
        return max(1, min(MAX_PCT, int(100.0 * self.downtime_s
                                       / (self.downtime_s + SLICE_S))))

    def decide(self, s: Snapshot) -> list[Action]:
        raw = s.page_rate or s.bandwidth
        b = self.rate.add(raw)
        w = self.wire.add(s.bandwidth)  # 0 until the stream reported one
        self._peak = max(self._peak, raw)
        self.share.add(s.vcpu_share)
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
        if self.switchover_w > 0:
            w = self.switchover_w  # QEMU's switchover decision takes it as it is
        elif w > 0:
            w = min(w, b)  # QEMU's own estimate: the wire rate, at most the page rate
        else:
            w = b
        if self._measure_rounds:
            self._measure_rounds -= 1  # a round in the fallback's codec: measured
            return []
        before = self.percent
        actions = self._round_start(s, b, w, prev_len, prev)
        throttle = next((a for a in actions if isinstance(a, SetThrottle)), None)
        if self._fallback is None or throttle is None or throttle.percent <= before:
            return actions
        method, cache, why = self._fallback
        self._fallback = None
        self.percent = before
        self._measure_rounds = 2 if cache else 1
        made = f" with a new {cache >> 20} MiB delta cache" if cache else ""
        rounds = "two rounds (the first fills the cache) are" if cache else "a round is"
        return [SetCompression(f"{throttle.reason.split(' -> ')[0]}; {why}: "
                               f"multifd-compression -> {method}{made} (re-sent pages "
                               f"as deltas) before any throttle, then {rounds} "
                               "measured", method, cache)]

    def _round_start(self, s: Snapshot, b: float, w: float, prev_len: float,
                     prev: tuple[float, int] | None) -> list[Action]:
        r = s.remaining
        budget = w * self.downtime_s  # what QEMU will switch over with
        if r <= budget or prev_len <= 0:
            return []
        if prev is None and self._switch_pending:
            self._switch_pending = False  # measure a round of the new codec first
            return []
        d = r / prev_len  # distinct bytes dirtied per second in the last round
        if s.dirty_rate > 0:
            d = min(d, s.dirty_rate)
        now = self.percent / 100.0
        # what the rounds did, not only what the rates say: syncs also happen mid-pass
        # and a hot set saturates, so the slower of the last two rounds' shrink counts,
        # each as it would have been unthrottled: the last round ran under ``now``, the
        # one before under the throttle of its own time (an unthrottled round's 0.9
        # is not 9 once a 90 % throttle came after it)
        ratio = (r / prev[1] if prev is not None and prev[1] > 0 else 0.0) / (1.0 - now)
        shrink, self._ratio = max(ratio, self._ratio), ratio
        free = max(d / b / (1.0 - now), shrink)
        t_round = r / b
        if prev is None and d / self._peak / (1.0 - now) <= 1.0:
            # one pass is all the evidence, and its rates are the least sure (host
            # noise, a slow start): unless the guest outran even the fastest drain the
            # pass showed, a throttle set now may rest on a wrong estimate (it costs
            # θ × T_round) while waiting costs one unthrottled round: measure first
            return []
        saturated = (prev is not None and s.rounds >= 4 and prev[0] > 0 and prev[1] > 0
                     and prev_len < SHORTER * prev[0]
                     and r / prev[1] > prev_len / prev[0] + SATURATED_BY)
        max_rounds = 1 if saturated else MAX_ROUNDS
        theta, rounds = plan(t_round, free, SAFETY * budget / r, max_rounds=max_rounds)
        full = b * self.downtime_s  # the budget at the drain's rate (guest bytes)
        if full > budget and (self.full_budget or max(theta, now) >= FULL_AT):
            # the guest is (or was) to be held at half speed or less: the pause the
            # limit allows costs it less than the rounds a wire-rate budget takes
            # (module's text)
            self.full_budget = True
            budget = full
            theta, rounds = (0.0, 0) if r <= budget else plan(
                t_round, free, SAFETY * budget / r, max_rounds=max_rounds)
        top = self.max_pct
        pct = max(self.percent, min(top, round(100.0 * theta + 0.5) if theta else 0))
        why = (f"round {s.rounds}: {r >> 20} MiB dirty (distinct rate {d / 2**20:.0f} MiB/s, "
               f"drained at {b / 2**20:.0f} MiB/s, {w / 2**20:.0f} MiB/s on the wire, "
               f"downtime budget {budget / 2**20:.1f} MiB"
               f"{' at the drain' if self.full_budget and budget == full else ''})")
        if saturated and prev is not None:
            why += (f"; the last round took {prev_len / prev[0]:.0%} of the one before "
                    f"and left {r / prev[1]:.0%} of its remainder: a set the guest "
                    "fills within a round, which only one deep round shrinks")
        share = self.share.value or 0.0
        deep = deep_pct(share)
        if pct > deep and t_round > DEEP_MAX_S and self.percent < deep:
            pct = deep  # the round would keep the guest below 10 % too long: shrink R first
            got = (f"the vCPUs get {share:.0%} of the CPU they ask for" if share
                   else "the vCPUs' share of the CPU not read")
            why += (f"; needs more than {deep}% for {t_round:.1f}s: {deep}% this round "
                    f"({got}: {deep}% leaves the guest {(100 - deep) * (share or 1):.0f}% "
                    f"of its speed in every {WINDOW_S * 1000:.0f} ms)")
        stalled = prev is not None and r >= STALL * prev[1]
        if pct >= top and self.percent >= top and stalled:
            self._at_max += 1
            if self._at_max > HOLD_ROUNDS:
                self.exhausted = True
                return [StrategyExhausted(f"throttle held {top}% (the deepest whose sleeps "
                                          f"fit the downtime limit) for {HOLD_ROUNDS} "
                                          f"rounds without converging")]
        if pct == self.percent:
            return []
        self.percent = pct
        return [SetThrottle(f"{why} -> {pct}% to converge in {rounds} more "
                            f"round{'s' if rounds != 1 else ''}", pct)]


def deep_pct(share: float) -> int:
    """The cap of a long deep round: the deepest throttle whose every ``WINDOW_S`` of
    the guest's time holds ``n`` of the vCPU's run slices with ``n × share > 1``, so
    that the guest keeps more than a tenth of its speed in each (module's text);
    ``share``: the vCPUs' share of the CPU they ask for, 0 when unknown (taken as 1)."""
    k = share if 0.0 < share < 1.0 else 1.0
    n = math.floor(1.0 / k) + 1
    return max(MIN_DEEP, round(100.0 * (1.0 - n * SLICE_S / WINDOW_S)))


def plan(t_round: float, free: float, target: float,
         max_rounds: int = MAX_ROUNDS) -> tuple[float, int]:
    """(θ, n): the throttle, and the rounds it takes (at most ``max_rounds``), that
    shrink the remainder to ``target`` (a share of it) at the least guest work lost
    plus ``TIME_COST`` per second. ``t_round``: the next round's length; ``free``:
    how much each round leaves of the one before with no throttle at all (q at
    θ = 0)."""
    best: tuple[float, float, int] | None = None  # (cost, θ, n)
    for n in range(1, max_rounds + 1):
        q_n = target ** (1.0 / n)
        theta = max(0.0, 1.0 - q_n / free) if free > 0 else 0.0
        q = min(q_n, free) if theta == 0.0 else q_n
        t = t_round * sum(q ** j for j in range(n))
        cost = theta * t + TIME_COST * t
        if best is None or cost < best[0] - 1e-12:
            best = (cost, theta, n)
        if theta == 0.0:
            return best[1], best[2]  # more rounds only add time
    assert best is not None
    if 0.0 < free < 1.0 and max_rounds == MAX_ROUNDS:
        # rounds that shrink on their own, only slower than MAX_ROUNDS allows (a small
        # budget: compression makes QEMU's wire-rate budget small): leaving them alone
        # costs only time, a light throttle costs θ of every one of its seconds
        n = math.ceil(math.log(target) / math.log(free)) if target < 1.0 else 1
        t = t_round * sum(free ** j for j in range(n))
        if n <= MAX_FREE_ROUNDS and TIME_COST * t < best[0]:
            return 0.0, n
    return best[1], best[2]
