"""The rewritten-pages curve: fitted from two counts, without a VM."""

from __future__ import annotations

import math

import pytest

from livemig.policy.dirtying import DirtyCurve, fit

MIB = float(1 << 20)


def _f(h: float, lam: float, t: float) -> float:
    return h + (1 - h) * -math.expm1(-lam * t)


@pytest.mark.parametrize(("h", "lam"), [(0.15, 0.7), (0.0, 0.3), (0.05, 0.05)])
def test_fit_recovers_the_hot_share_and_the_cold_rate(h: float, lam: float) -> None:
    c = fit(256 * MIB, _f(h, lam, 0.7), 0.7, _f(h, lam, 0.45), 0.45)
    assert c.linear is None
    assert c.hot == pytest.approx(h, abs=1e-9)
    assert c.cold_rate == pytest.approx(lam, rel=1e-9)
    # and it predicts a long round as the model of the guest does
    assert c.dirtied(2.2) == pytest.approx(256 * MIB * _f(h, lam, 2.2), rel=1e-9)


def test_a_saturated_hot_set_is_not_extrapolated_as_a_rate() -> None:
    """15 % of the pages rewritten at 0.45 s and still 15 % at 0.7 s: a hot set. A
    linear rate from one count would say a 7 s round re-dirties 150 % of the memory."""
    c = fit(400 * MIB, 0.15, 0.7, 0.15, 0.45)
    assert c.hot == pytest.approx(0.15)
    assert c.cold_rate == 0.0
    assert c.dirtied(7.0) == pytest.approx(0.15 * 400 * MIB)
    assert fit(400 * MIB, 0.15, 0.7).dirtied(7.0) == 400 * MIB  # linear: capped at all


def test_the_throttle_stretches_the_curve() -> None:
    c = fit(256 * MIB, _f(0.1, 0.5, 0.7), 0.7, _f(0.1, 0.5, 0.45), 0.45)
    assert c.dirtied(2.0, throttle=0.5) == pytest.approx(c.dirtied(1.0))
    # a short round reaches only part of the hot set, at its rate
    assert c.dirtied(0.01) < 0.1 * 256 * MIB * 0.1
    assert c.rate(0.5) == pytest.approx(c.rate() / 2)


def test_one_count_or_a_degenerate_pair_gives_the_linear_rate() -> None:
    assert fit(100 * MIB, 0.2, 0.5).linear == pytest.approx(40 * MIB)
    assert fit(100 * MIB, 0.2, 0.5, 0.1, 0.49).linear is not None  # counts 10 ms apart
    assert fit(100 * MIB, 1.0, 0.5, 0.5, 0.25).linear is not None  # all rewritten
    # noise: fewer rewritten at the later look is read as no cold accrual
    c = fit(100 * MIB, 0.10, 0.7, 0.12, 0.45)
    assert c.hot == pytest.approx(0.10) and c.cold_rate == 0.0
    assert DirtyCurve(MIB, linear=MIB).dirtied(5.0) == MIB


def test_qemus_short_count_sets_how_fast_the_hot_set_fills() -> None:
    """The looks half a second apart only bound the hot set's speed from below (full by
    the half-way look); QEMU's count of pages dirtied in 100 ms gives it."""
    f = _f(0.10, 0.4, 0.7)
    looks = fit(300 * MIB, f, 0.7, _f(0.10, 0.4, 0.45), 0.45)
    counted = fit(300 * MIB, f, 0.7, _f(0.10, 0.4, 0.45), 0.45,
                  short=(25 * MIB, 0.1))  # 25 MiB dirtied in 100 ms
    assert counted.hot == pytest.approx(looks.hot)
    assert counted.hot_rate > 2 * looks.hot_rate
    assert counted.dirtied(0.1) == pytest.approx(25 * MIB)  # the curve meets the count
    # a count below what the looks imply changes nothing
    slow = fit(300 * MIB, f, 0.7, _f(0.10, 0.4, 0.45), 0.45, short=(1 * MIB, 0.1))
    assert slow.hot_rate == looks.hot_rate


def test_a_hot_set_the_looks_missed_shows_in_qemus_count() -> None:
    """A busy-db sample (docs/results/attach-stock-2026-11-27d, run 1): 87 then 129 of
    696 pages rewritten at 0.55 and 0.79 s read as cold accrual alone (no hot set),
    90 MiB/s for a short round; QEMU saw 356 MiB/s over 101 ms. The excess is a hot
    set, at least as big as what it gave in the window."""
    nonzero = 348 * MIB
    looks = fit(nonzero, 129 / 696, 0.791, 87 / 696, 0.545)
    assert looks.hot == 0.0
    counted = fit(nonzero, 129 / 696, 0.791, 87 / 696, 0.545, short=(356 * MIB * 0.101, 0.101))
    assert 0.05 < counted.hot < 87 / 696
    assert counted.dirtied(0.101) == pytest.approx(356 * MIB * 0.101, rel=0.05)
    assert counted.rate() > 3 * looks.rate()
