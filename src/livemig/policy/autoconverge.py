"""Pre-copy on a QEMU that converges by its own auto-converge, round by round.

On a QEMU without livemig's ``set-cpu-throttle`` (stock 10.2) the profile leaves the
throttle to QEMU, as the stock profiles do. Its ladder is slow, and how slow decides
which stream encoding wins: QEMU 10.2's ``migration_trigger_throttle()`` looks at the
dirty bitmap's syncs at most once a second; a period in which the guest dirtied more
page bytes than half the bytes the stream *transferred* (wire bytes: compression makes
a period look busier) counts as high, and every second high period raises the throttle
(``cpu-throttle-initial`` 20 %, then ``cpu-throttle-increment`` 10 points). QEMU
switches over when what is left fits the downtime limit at the stream's wire rate
(livemig's switchover-bandwidth policy makes it the page rate once the throttle holds
the guest at half speed or less: ``full_at``).

So a guest that needs a 60 % throttle to converge is throttled for ten seconds on the
way there whatever the encoding, unless the encoding's re-sends are so fast that the
rounds shrink without it. That is xbzrle's case for small rewrites: its first re-send
of a page is whole, but from the next one on a rewritten row costs a few dozen bytes,
encoded at the migration thread's speed (hundreds of MB/s of pages); multifd zstd
re-sends the page, compressed, at the link's pace. The recorded flat-out ``records``
guest (docs/results/handstarted-2026-11-27b): stock zstd took 18 s with the throttle
up to 70 % (12.7 s of guest work lost), xbzrle 11.0 s (1.4 s).

:func:`simulate` plays the rounds: each sends what the last one left dirty
(:class:`~livemig.policy.dirtying.DirtyCurve` under the current throttle), QEMU's
period check runs at the syncs, and the result is the time, the page and wire bytes
and the guest work the throttle took (``θ × round``). Pure: no QEMU.
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.policy.dirtying import DirtyCurve

INITIAL = 0.20  # cpu-throttle-initial
INCREMENT = 0.10  # cpu-throttle-increment
MAX = 0.99  # max-cpu-throttle
TRIGGER = 0.50  # throttle-trigger-threshold: dirtied > this × transferred is "high"
PERIOD_S = 1.0  # the check runs at a sync at least this long after the last check
DOWNTIME_S = 0.3  # downtime-limit (QEMU's default and the stock profiles')
MAX_S = 600.0  # a migration not done by then is scored as this long


@dataclass(frozen=True)
class Stream:
    """A re-send rate: page bytes per second, and page bytes per wire byte."""

    rate: float
    ratio: float


@dataclass(frozen=True)
class Run:
    seconds: float
    round_bytes: tuple[float, ...]  # guest bytes of each round (the switchover's last)
    wire_bytes: float
    work_lost: float  # seconds of guest work the throttle took
    throttle: float  # the throttle at the switchover

    @property
    def page_bytes(self) -> float:
        """Guest bytes sent, every round and the switchover."""
        return sum(self.round_bytes)

    @property
    def rounds(self) -> int:
        """Rounds before the switchover (the first pass is round 1)."""
        return len(self.round_bytes) - 1


def simulate(first: Stream, resend: Stream, curve: DirtyCurve, *,
             later: Stream | None = None, downtime_s: float = DOWNTIME_S,
             full_at: float | None = None) -> Run:
    """A first pass over ``curve.nonzero`` bytes at ``first``, the next round at
    ``resend``, every round after it at ``later`` (default ``resend``: xbzrle's first
    re-send is whole pages, its later ones deltas). ``full_at``: from this throttle
    on, the switchover budget is the stream's page rate × the limit, not its wire
    rate (livemig's switchover-bandwidth policy tells QEMU so, policy/convergence.py)."""
    t = work = wire = 0.0
    throttle = 0.0
    high = 0
    period_dirty = period_wire = 0.0
    period_start = 0.0
    left = curve.nonzero
    stream = first
    sent: list[float] = []
    while True:
        dt = left / stream.rate
        t += dt
        work += throttle * dt
        sent.append(left)
        wire += left / stream.ratio
        period_wire += left / stream.ratio
        dirty = min(curve.nonzero, curve.dirtied(dt, throttle))
        period_dirty += dirty
        if t - period_start > PERIOD_S:  # QEMU's migration_trigger_throttle()
            if period_dirty > TRIGGER * period_wire:
                high += 1
                if high >= 2:
                    high = 0
                    throttle = INITIAL if throttle == 0 else min(MAX, throttle + INCREMENT)
            period_dirty = period_wire = 0.0
            period_start = t
        left = dirty
        stream = resend if len(sent) == 1 else (later or resend)
        # the switchover: what is left fits the downtime at the stream's wire rate
        # (at its page rate once the throttle reached ``full_at``)
        full = full_at is not None and throttle >= full_at
        rate = stream.rate if full else stream.rate / stream.ratio
        if left <= rate * downtime_s or t >= MAX_S:
            final = left / stream.rate
            return Run(min(t + final, MAX_S), (*sent, left), wire + left / stream.ratio,
                       work, throttle)
