"""QEMU 10.2's auto-converge ladder, played round by round without a VM."""

from __future__ import annotations

import pytest

from livemig.policy import autoconverge as ac
from livemig.policy.dirtying import DirtyCurve

MIB = float(1 << 20)
LINK = 50 * MIB


def test_an_idle_guest_is_one_pass_and_never_throttled() -> None:
    run = ac.simulate(ac.Stream(LINK, 1.0), ac.Stream(LINK, 1.0), DirtyCurve(256 * MIB))
    assert run.rounds == 1
    assert run.seconds == pytest.approx(256 * MIB / LINK)
    assert run.throttle == 0 and run.work_lost == 0


def test_the_ladder_climbs_to_its_maximum_for_a_hot_set_no_throttle_can_shrink() -> None:
    """A hot set of 100 MiB rewritten at once, whatever the round's length: each
    round after the first pass is 2 s, a period, high; every second one raises the
    throttle: 20 % after round 3, then +10 points every 4 s, 99 % after ~37 s. It
    never fits the downtime (15 MiB), so the run is scored at the cap, with the
    throttle's work lost."""
    curve = DirtyCurve(100 * MIB, hot=1.0, hot_rate=1e15)
    run = ac.simulate(ac.Stream(LINK, 1.0), ac.Stream(LINK, 1.0), curve)
    assert run.throttle == ac.MAX
    assert run.seconds == ac.MAX_S
    # at most 2 s at 0 %, 4 s at 20 %, ..., then 99 % to the cap
    expected = 4 * sum(p / 100 for p in range(20, 100, 10)) + 0.99 * (ac.MAX_S - 38)
    assert run.work_lost == pytest.approx(expected, rel=0.02)


def test_a_guest_slow_enough_by_itself_is_not_throttled() -> None:
    """Rounds that shrink below half the wire bytes sent are not high periods."""
    curve = DirtyCurve(256 * MIB, linear=20 * MIB)
    run = ac.simulate(ac.Stream(LINK, 1.0), ac.Stream(LINK, 1.0), curve)
    assert run.throttle == 0 and run.work_lost == 0
    assert run.rounds > 2
    assert run.round_bytes[0] == 256 * MIB  # the first pass, then shrinking rounds
    assert sum(run.round_bytes) == pytest.approx(run.page_bytes)
    assert list(run.round_bytes[1:]) == sorted(run.round_bytes[1:], reverse=True)


def test_compression_makes_a_period_look_busier() -> None:
    """QEMU compares page bytes dirtied with *wire* bytes sent: at ratio 3 the same
    guest counts as high where an uncompressed stream would not."""
    plain = ac.simulate(ac.Stream(LINK, 1.0), ac.Stream(LINK, 1.0),
                        DirtyCurve(256 * MIB, linear=20 * MIB))
    packed = ac.simulate(ac.Stream(3 * LINK, 3.0), ac.Stream(3 * LINK, 3.0),
                         DirtyCurve(256 * MIB, linear=60 * MIB))
    assert plain.throttle == 0
    assert packed.throttle > 0


def test_deltas_after_a_whole_round_converge_without_the_ladder() -> None:
    """xbzrle: the first re-send round goes whole, later ones as deltas at the
    migration thread's pace; a flat-out hot set converges once they start."""
    curve = DirtyCurve(256 * MIB, hot=0.15, hot_rate=80 * MIB, cold_rate=0.7)
    whole = ac.Stream(LINK, 1.0)
    xbzrle = ac.simulate(whole, whole, curve, later=ac.Stream(500e6, 30.0))
    zstd = ac.simulate(ac.Stream(2.2 * LINK, 2.2), ac.Stream(2.2 * LINK, 2.2), curve)
    assert xbzrle.seconds < zstd.seconds
    assert xbzrle.work_lost < zstd.work_lost
    assert xbzrle.rounds >= 3


def test_a_guest_that_never_converges_is_scored_at_the_cap() -> None:
    curve = DirtyCurve(256 * MIB, linear=1e12)
    run = ac.simulate(ac.Stream(1 * MIB, 1.0), ac.Stream(1 * MIB, 1.0), curve)
    assert run.seconds == ac.MAX_S
