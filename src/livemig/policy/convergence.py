"""Downtime ramp and the last resort.

``DowntimeRamp``: while rounds do not shrink, raise ``downtime-limit`` step by step
(×``FACTOR`` per stalled round) up to ``max-downtime``: a migration that is 'almost
there' switches over with a slightly longer pause instead of never.

``LastResort``: when the strategy is exhausted, force the switchover (the pause is
then as long as the remainder takes; the user is told), abort keeping the source
running, or switch to post-copy.

``SwitchoverBandwidth``: once the first pass is over, tell QEMU the rate the stream
achieves while it has work queued (``avail-switchover-bandwidth``), and again when
that rate moves, so that its switchover decision stops resting on the last 100 ms.

``AfterFirstPass``: once the first pass is over, switch the stream to the codec its
encoding uses for re-sent pages (zstd+delta: lz4 deltas after a zstd first pass).

``PostcopyAfter``: switch to post-copy once pre-copy has run a set time without
completing (KubeVirt's ``completionTimeoutPerGiB`` with ``allowPostCopy``, per
migration): a bound on how long the migration holds the source, whatever the guest
does, at the price of a destination that runs before it has all of its RAM.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from livemig.policy.base import (
    AbortMigration,
    Action,
    ForceSwitchover,
    RoundTracker,
    SetCompression,
    SetDowntimeLimit,
    SetSwitchoverBandwidth,
    Snapshot,
    StartPostcopy,
    StrategyExhausted,
)

FACTOR = 1.5
FORCE_DOWNTIME_MS = 60_000  # "whatever it takes": the remainder at link speed
ON_STALL = ("force", "abort", "postcopy")
WINDOW = 8  # busy polls the switchover rate is taken over (2 s at the default poll)
CHANGE = 0.2  # the switchover rate is set again when it moves by more than this share
FULL_AT = 50  # % of throttle from which the switchover rate is in guest bytes (no converge)


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


class SwitchoverBandwidth:
    """QEMU switches over once what is left fits ``downtime-limit`` × its bandwidth
    estimate, and it estimates the bandwidth from the bytes of the last 100 ms window.
    At the end of a throttled migration the rounds carry a few pages each and the link
    idles most of every window: the estimate falls to kB/s and the remainder never
    fits. Measured (the records guest, flat-out 128-byte writes, 50 MiB/s, converge
    throttle): 30 pages left, QEMU's expected downtime 3986 ms, the guest held at
    97-98 % for 2.5 s (3.3 s below 10 % of normal, the run of three that missed the
    3 s target).

    QEMU's ``avail-switchover-bandwidth`` (8.2) replaces the estimate in that decision.
    This sets it once the first pass is over, to the median of the rates QEMU reported
    in the last :data:`WINDOW` polls that found the stream busy (at least a poll
    interval's worth of its usual rate still to send: a stream with work queued, as at
    the switchover, when the guest is stopped and its CPU free), and again whenever
    that rate moves by more than :data:`CHANGE` (an evacuation's link share raises and
    lowers a stream's cap from outside: a first pass held to 1.1 MiB/s and then let go
    at 12 MiB/s must not switch over as if it still crawled).

    Which rate: QEMU compares the remainder in *guest* bytes with it. The wire rate
    (``mbps``, at most ``cap``, an explicit --bandwidth) is what QEMU would estimate
    itself: under compression the pause then comes out shorter than the limit by the
    compression ratio (lz4 deltas of 128-byte rows: 15 ms at a 1000 ms limit), and the
    rounds go on until the remainder is that much smaller. That is the right price
    while the guest runs free: another round costs it little. While a throttle holds
    it, every second of another round costs the guest the throttle's share of it, and
    the pause the limit allows is the cheaper price; ``full(s)`` says when (the
    converge throttle's own choice, :class:`~livemig.policy.converge.ConvergeThrottle`
    weighs both; without it a throttle of at least :data:`FULL_AT` %, QEMU's
    auto-converge included), and the policy then tells QEMU the rate guest pages
    drained at (``pages-per-second``), capped at ``cap`` times the polls' ratio of
    page to wire bytes. Only re-send rounds count for it: the first pass's zero pages
    drain at memory speed and say nothing of a remainder of rewritten ones."""

    name = "switchover-bandwidth"

    def __init__(self, cap: int | None = None,
                 full: Callable[[Snapshot], bool] | None = None) -> None:
        self.cap = cap
        self.full = full or (lambda s: s.throttle_pct >= FULL_AT)
        self.busy: deque[float] = deque(maxlen=WINDOW)  # wire bytes/s
        self.pages: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (page, wire) re-sends
        self.rate = 0.0  # what QEMU was told, 0: nothing yet
        self.guest_bytes = False  # what it was told is the guest-byte rate
        self._t: float | None = None

    def decide(self, s: Snapshot) -> list[Action]:
        dt = s.t - self._t if self._t is not None else 0.0
        self._t = s.t
        # busy: what was left would have kept the stream going for the whole poll at
        # its usual rate (a collapsed rate of a few pages' rounds is no measure)
        usual = max(s.bandwidth, self._median())
        if s.bandwidth > 0 and dt > 0 and s.remaining >= usual * dt:
            self.busy.append(s.bandwidth)
            if s.rounds > 1 and s.page_rate > 0:
                self.pages.append((s.page_rate, s.bandwidth))
        if s.rounds <= 1 or not self.busy:
            return []
        rate = self._median()
        if self.cap:
            rate = min(rate, float(self.cap))
        guest = bool(self.pages) and self.full(s)
        if guest:
            page = statistics.median(p for p, _ in self.pages)
            ratio = max(1.0, statistics.median(p / w for p, w in self.pages))
            rate = max(rate, min(page, float(self.cap) * ratio if self.cap else page))
        if (self.rate and guest == self.guest_bytes
                and abs(rate - self.rate) <= CHANGE * self.rate):
            return []
        why = ("first pass over" if not self.rate else
               "the guest is throttled" if guest and not self.guest_bytes else
               "the throttle is off" if self.guest_bytes and not guest else
               "the stream's rate moved")
        self.rate, self.guest_bytes = rate, guest
        what = (f"the median rate guest pages drained at in the last {len(self.pages)} "
                "busy re-send polls" if guest else
                f"the median wire rate of the last {len(self.busy)} busy polls")
        return [SetSwitchoverBandwidth(
            f"{why}: avail-switchover-bandwidth -> {rate / 2**20:.1f} MiB/s ({what})",
            int(rate), guest_bytes=guest)]

    def _median(self) -> float:
        return statistics.median(self.busy) if self.busy else 0.0


class AfterFirstPass:
    """An encoding whose first pass and re-send rounds use different codecs: the first
    pass sends every non-zero page once, whatever the guest does later, so the codec
    with the best ratio the CPU can feed suits it (zstd); a page sent again was
    rewritten, and if only a few of its bytes changed, an lz4 delta against the copy
    the first pass left in the delta cache (patches 0005, 0013) is a few dozen bytes.
    This switches the codec once QEMU's first dirty-bitmap sync after the pass is
    seen (``rounds`` > 1). Pages of the new round already queued go in the old codec:
    both are complete encodings, only the bytes differ."""

    name = "after-first-pass"

    def __init__(self, method: str) -> None:
        self.method = method
        self.fired = False

    def decide(self, s: Snapshot) -> list[Action]:
        if self.fired or s.rounds <= 1:
            return []
        self.fired = True
        return [SetCompression(f"first pass over: multifd-compression -> {self.method} "
                               "for the re-sent pages", self.method)]


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
