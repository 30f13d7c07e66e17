"""How much of the guest's memory it rewrites in a given time: the curve behind every
re-send round.

A sampler that reads pages itself looks at the same random pages three times: at 0,
at ``t_mid`` and at ``t``, and counts the share of them rewritten since the first look
(``f_mid``, ``f``). One point of that curve gives only a rate; two tell its shape
apart, with the simplest model that fits real memory:

- a **hot set** (share ``h``) rewritten over and over, whole before the first count:
  rows a database updates, counters. A long round re-sends it once, a short round as
  much of it as the guest reaches in that time;
- a **cold set** (the rest) whose pages are rewritten now and then, each independently
  at ``λ`` per second: after ``t`` seconds ``1 − e^(−λt)`` of it is dirty. It keeps
  accruing in long rounds, and saturates only when most of it was written.

So ``f(t) = h + (1 − h)(1 − e^(−λt))``, and the two counts give ``λ = ln((1 − f_mid)
/ (1 − f)) / (t − t_mid)`` and ``1 − h = (1 − f_mid) e^(λ t_mid)``. A throttle that
holds the guest at ``1 − θ`` of its speed stretches the curve: ``f((1 − θ) t)``.

This matters as soon as rounds are longer than the sample's interval. A flat-out writer
with a hot set (the recorded ``records`` guest, tests/data/samples: ``h`` 0.13-0.19,
``λ`` 0.27-0.58/s) re-dirties most of its memory in a 2 s round, where a rate read
from one 0.7 s interval and cut linearly by the throttle says its rounds shrink by half
each time they are throttled 20 %: they did not (1.8, 1.6, 1.25 s... 39 rounds,
docs/results/handstarted-2026-11-27b).

The looks bound the hot set's speed only from below (full by the half-way look). A
third point comes from QEMU: its estimate of what the guest dirties in 100 ms
(``calc-dirty-rate``, :mod:`livemig.sampling.dirtyrate`). Where that window holds
more than the looks' hot set can give, the hot set fills at that speed (and is at
least that big): on the records guest 400-480 MiB/s, so a round must be a few tens of
ms, at a throttle of 70-80 %, before what is left fits the downtime.

With one point only (the patched QEMU's sampler takes two looks) the curve is the rate
of the one interval, linear: what the model always used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MIN_GAP = 0.05  # seconds between the two counts below which their difference is noise


@dataclass(frozen=True)
class DirtyCurve:
    nonzero: float  # bytes of the guest's memory that hold data
    hot: float = 0.0  # share of it rewritten over and over
    hot_rate: float = 0.0  # bytes/s at which a round re-dirties the hot set (at least)
    cold_rate: float = 0.0  # λ: per second, the chance a cold page is rewritten
    linear: float | None = None  # bytes/s: the one-point curve (no shape known)

    def dirtied(self, seconds: float, throttle: float = 0.0) -> float:
        """Bytes rewritten in ``seconds`` with the guest held at ``1 − throttle``."""
        t = max(0.0, seconds) * (1.0 - min(max(throttle, 0.0), 1.0))
        if self.linear is not None:
            return min(self.nonzero, self.linear * t)
        hot = min(self.hot * self.nonzero, self.hot_rate * t)
        cold = (1.0 - self.hot) * self.nonzero * -math.expm1(-self.cold_rate * t)
        return hot + cold

    def rate(self, throttle: float = 0.0) -> float:
        """Bytes/s dirtied in a short round: the curve's slope at 0."""
        if self.linear is not None:
            return self.linear * (1.0 - throttle)
        cold = (1.0 - self.hot) * self.nonzero * self.cold_rate
        return (self.hot_rate + cold) * (1.0 - throttle)


def fit(nonzero: float, f: float, t: float, f_mid: float | None = None,
        t_mid: float | None = None, short: tuple[float, float] | None = None
        ) -> DirtyCurve:
    """The curve through the sample's counts: ``f`` of the pages rewritten after ``t``
    seconds and, when the sampler looked in between, ``f_mid`` after ``t_mid``;
    ``short``: (bytes, seconds) QEMU counted dirtied in a short window, which sets
    how fast the hot set fills (the looks give only a lower bound)."""
    curve = _fit(nonzero, f, t, f_mid, t_mid)
    if short is None or curve.linear is not None or short[1] <= 0:
        return curve
    dirtied, t_s = short
    cold = (1.0 - curve.hot) * nonzero * -math.expm1(-curve.cold_rate * t_s)
    hot = dirtied - cold  # what the hot set gave in the window
    if hot <= curve.hot_rate * t_s:
        return curve
    # more than the looks' hot set gives in the window: the hot set is at least that
    # big (and no bigger than what was rewritten by the half-way look). The looks
    # alone can miss it: 87 then 129 of 696 pages rewritten read as cold accrual only
    # on a busy-db sample where QEMU saw 36 MiB dirtied in 100 ms, 4x that accrual
    share = min(max(curve.hot, hot / nonzero), f_mid if f_mid is not None else 1.0)
    return replace(curve, hot=share, hot_rate=hot / t_s)


def _fit(nonzero: float, f: float, t: float, f_mid: float | None,
         t_mid: float | None) -> DirtyCurve:
    f = min(max(f, 0.0), 1.0)
    if f_mid is None or t_mid is None or t - t_mid < MIN_GAP or t_mid <= 0 or f >= 1.0:
        return DirtyCurve(nonzero, linear=nonzero * f / max(t, 1e-3))
    f_mid = min(max(f_mid, 0.0), f)  # pages rewritten by t_mid stay rewritten at t
    lam = math.log((1.0 - f_mid) / (1.0 - f)) / (t - t_mid)
    hot = 1.0 - (1.0 - f_mid) * math.exp(lam * t_mid)
    hot = min(max(hot, 0.0), f_mid)
    # λ again for the clamped hot share, from the later (larger) count; none when
    # everything rewritten was hot
    lam = 0.0 if hot >= f_mid else max(0.0, -math.log((1.0 - f) / (1.0 - hot)) / t)
    return DirtyCurve(nonzero, hot=hot, hot_rate=hot * nonzero / t_mid, cold_rate=lam)
