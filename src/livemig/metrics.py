"""Pure computations on what the host observed: pauses and workload throughput.

All inputs are host timestamps (``time.time()``) and cumulative counters, so these
functions are unit-tested with synthetic traces, no VM needed.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class WorkSample(Protocol):
    """A cumulative work counter at a host time: the guest agent's rate reports
    (bytes dirtied and written) or a service client's completed operations."""

    @property
    def t(self) -> float: ...

    @property
    def work(self) -> float: ...


BIN_S = 0.1  # throughput is judged in 100 ms bins, the agent's report period


@dataclass(frozen=True)
class Gap:
    seconds: float
    start: float
    end: float


def longest_gap(times: Sequence[float], start: float, end: float) -> Gap | None:
    """Longest interval without a heartbeat inside [start, end].

    Heartbeats from both ends of the migration are merged; the window edges count
    as heartbeats only where a real one exists outside them (so a channel that only
    starts late does not count as a pause at the window start).
    """
    ts = sorted(times)
    if len(ts) < 2:
        return None
    i = max(bisect.bisect_left(ts, start) - 1, 0)
    j = min(bisect.bisect_right(ts, end) + 1, len(ts))
    window = ts[i:j]
    best: Gap | None = None
    for a, b in itertools.pairwise(window):
        if b < start or a > end:
            continue
        if best is None or b - a > best.seconds:
            best = Gap(b - a, a, b)
    return best


def merged_counter(samples: Sequence[WorkSample]) -> list[tuple[float, float]]:
    """(time, cumulative work) merged over channels, sorted, made monotonic."""
    pts = sorted((s.t, float(s.work)) for s in samples)
    out: list[tuple[float, float]] = []
    high = 0.0
    for t, w in pts:
        high = max(high, w)
        out.append((t, high))
    return out


def _value_at(pts: Sequence[tuple[float, float]], times: Sequence[float], t: float) -> float:
    k = bisect.bisect_left(times, t)
    if k <= 0:
        return float(pts[0][1])
    if k >= len(pts):
        return float(pts[-1][1])
    (t0, v0), (t1, v1) = pts[k - 1], pts[k]
    if t1 == t0:
        return float(v1)
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def rate_series(
    samples: Sequence[WorkSample], start: float, end: float, bin_s: float = BIN_S
) -> list[tuple[float, float]]:
    """Throughput (bytes/s) in consecutive bins over [start, end], interpolated from
    the cumulative counters; bins inside a silence get the little the counter moved."""
    pts = merged_counter(samples)
    if len(pts) < 2 or end <= start:
        return []
    times = [p[0] for p in pts]
    out: list[tuple[float, float]] = []
    t = start
    prev = _value_at(pts, times, t)
    while t + bin_s <= end + 1e-9:
        cur = _value_at(pts, times, t + bin_s)
        out.append((t, (cur - prev) / bin_s))
        prev = cur
        t += bin_s
    return out


def average_rate(samples: Sequence[WorkSample], start: float, end: float) -> float | None:
    pts = merged_counter([s for s in samples if start <= s.t <= end])
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


@dataclass(frozen=True)
class WorkloadStats:
    baseline_rate: float | None
    min_rate: float | None
    mean_rate_during: float | None
    seconds_below_10pct: float | None
    seconds_below_50pct: float | None
    work_lost_s: float | None = None
    baseline_spread_pct: float | None = None

    def as_dict(self) -> dict[str, float | None]:
        return {
            "baseline_rate": self.baseline_rate,
            "baseline_spread_pct": self.baseline_spread_pct,
            "min_rate": self.min_rate,
            "mean_rate_during": self.mean_rate_during,
            "seconds_below_10pct": self.seconds_below_10pct,
            "seconds_below_50pct": self.seconds_below_50pct,
            "work_lost_s": self.work_lost_s,
        }


def work_lost_net(rates: Sequence[float], baseline: float, bin_s: float = BIN_S) -> float:
    """:func:`work_lost` without the clipping: a bin above normal pays back. Noisier
    per run, but the normal rate's own noise averages out instead of adding up, so a
    longer window is not judged worse for being longer."""
    if baseline <= 0:
        return 0.0
    return sum(1.0 - r / baseline for r in rates) * bin_s


def work_lost(rates: Sequence[float], baseline: float, bin_s: float = BIN_S) -> float:
    """Seconds of guest work lost: the integral of max(0, 1 - rate/normal) over the
    bins. It counts depth and duration together: 2 s at 50 % and 1 s at 0 % both lose
    1 s; a rate above normal (catching up after a pause) does not pay back a loss."""
    if baseline <= 0:
        return 0.0
    return sum(max(0.0, 1.0 - r / baseline) for r in rates) * bin_s


SPREAD_WINDOW_S = 1.0  # the normal rate's spread is judged over 1 s windows


def spread_pct(samples: Sequence[WorkSample], start: float, end: float,
               window_s: float = SPREAD_WINDOW_S) -> float | None:
    """How steady the normal rate is: the relative standard deviation (%) of the
    throughput in ``window_s`` windows over [start, end]; None with under 2 windows.
    Two runs' work-lost figures compare only when this is small against them."""
    series = rate_series(samples, start, end, window_s)
    rates = [r for _, r in series]
    if len(rates) < 2:
        return None
    mean = statistics.fmean(rates)
    if mean <= 0:
        return None
    return round(100.0 * statistics.stdev(rates) / mean, 1)


def workload_stats(
    samples: Sequence[WorkSample], baseline_start: float, start: float, end: float,
    exclude: tuple[float, float] | None = None,
) -> WorkloadStats:
    """Baseline from [baseline_start, start); dips judged over [start, end].

    Bins overlapping ``exclude`` (the time livemig itself held the guest paused to
    compare RAM, which a real migration does not have) are left out."""
    baseline = average_rate(samples, baseline_start, start)
    series = rate_series(samples, start, end)
    if exclude is not None:
        lo, hi = exclude
        series = [(t, r) for t, r in series if t + BIN_S <= lo or t >= hi]
    spread = spread_pct(samples, baseline_start, start)
    if not series:
        return WorkloadStats(baseline, None, None, None, None, None, spread)
    rates = [r for _, r in series]
    below10 = below50 = lost = None
    if baseline:
        below10 = round(sum(BIN_S for r in rates if r < 0.1 * baseline), 3)
        below50 = round(sum(BIN_S for r in rates if r < 0.5 * baseline), 3)
        lost = round(work_lost(rates, baseline), 3)
    return WorkloadStats(
        baseline_rate=baseline,
        min_rate=min(rates),
        mean_rate_during=sum(rates) / len(rates),
        seconds_below_10pct=below10,
        seconds_below_50pct=below50,
        work_lost_s=lost,
        baseline_spread_pct=spread,
    )
