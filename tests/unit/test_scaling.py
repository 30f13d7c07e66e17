"""The large-guest pre-copy model (pure arithmetic)."""

from __future__ import annotations

import math

import pytest

from livemig.scaling import GB, GIB, Costs, Guest, Method, distinct, predict

COSTS = Costs(sync_ms_per_gib=10.0, zero_scan_gib_s=4.0, sender_gb_s=100.0,
              cpu_s_per_gb=0.5, fixed_downtime_s=0.1)


def test_distinct_dirtying_saturates_at_the_set():
    assert distinct(GIB, GB, 0.001) == pytest.approx(GB * 0.001, rel=0.01)
    assert distinct(GIB, GB, 1000.0) == pytest.approx(GIB)
    assert distinct(0.0, GB, 1.0) == 0.0


def test_idle_guest_is_one_pass_plus_the_hidden_sync():
    g = Guest(ram_gib=64, data_fraction=1.0)
    p = predict(g, 10, COSTS)
    wire_s = 64 * GIB / (10e9 / 8 * 0.93)
    assert p.converged and p.rounds == 2
    assert p.ram_bytes == pytest.approx(64 * GIB)
    # round 0 (link-bound) + its sync + the final pause (sync + fixed)
    assert p.total_s == pytest.approx(wire_s + 2 * 0.64 + 0.1)
    assert p.hidden_sync_s == pytest.approx(0.64)
    assert p.downtime_real_s == pytest.approx(0.74)


def test_hidden_sync_grows_with_ram_and_breaks_the_asked_downtime():
    """The seed's 512 GiB case: 2 s asked, the sync on top of it."""
    g = Guest(ram_gib=512, data_fraction=1.0, warm_bytes=32 * GIB, warm_rate=0.3 * GB)
    p = predict(g, 10, COSTS, Method(downtime_limit_s=2.0))
    assert p.converged
    assert p.downtime_real_s > p.downtime_asked_s + 5.0  # 5.12 s of sync alone
    assert p.downtime_real_s <= 2.0 + 5.12 + 0.1 + 1e-9


def test_zero_pages_are_scanned_not_sent():
    g = Guest(ram_gib=16, data_fraction=0.0)
    p = predict(g, 100, COSTS)
    assert p.wire_bytes == 0.0
    assert p.total_s == pytest.approx(16 / 4.0 + 2 * 0.16 + 0.1)


def test_a_writer_faster_than_the_link_needs_the_throttle():
    g = Guest(ram_gib=8, data_fraction=1.0, hot_bytes=4 * GIB, hot_rate=4 * GB)
    stock = predict(g, 10, COSTS, Method(max_rounds=50))
    assert not stock.converged and stock.rounds == 51
    thr = predict(g, 10, COSTS, Method(throttle=(0.9, 0.99)))
    assert thr.converged and thr.rounds < 20
    assert thr.total_s < stock.total_s


def test_deferral_sends_the_hot_set_once():
    g = Guest(ram_gib=64, data_fraction=1.0, hot_bytes=2 * GIB, hot_rate=2 * GB,
              warm_bytes=16 * GIB, warm_rate=0.2 * GB)
    m = Method(throttle=(0.9, 0.99))
    plain = predict(g, 10, COSTS, m)
    deferred = predict(g, 10, COSTS, Method(throttle=(0.9, 0.99), defer_hot=True))
    assert deferred.ram_bytes < plain.ram_bytes
    assert math.isfinite(deferred.total_s)
