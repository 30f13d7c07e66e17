"""The evacuation benchmark's harm observer, fed agent lines with known times (no VM):
a guest that stopped for a second across its switchover loses about a second of work
and shows a one-second pause; its work on two hosts counts as one counter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from livemig.evacuate.harm import FleetWatch, net_lost, totals
from livemig.lab.agent import AgentLink

RATE = 10e6  # bytes/s of the guest's writer


def _feed(a: AgentLink, t0: float, t1: float, work0: float, step: float = 0.05) -> float:
    """Beats and counters every ``step`` s over [t0, t1) at RATE; the counter at t1."""
    t, w = t0, work0
    while t < t1 - 1e-9:
        a.handle_line('{"ev":"hb"}', t)
        a.handle_line(json.dumps({"ev": "rate", "mem_bytes": int(w)}), t)
        t += step
        w += RATE * step
    return w


def _watch() -> FleetWatch:
    w = FleetWatch(["calm", "moved"])
    calm = AgentLink("src", Path("/nonexistent"))
    _feed(calm, 0.0, 30.0, 0.0)
    src, dst = AgentLink("src", Path("/x")), AgentLink("dst", Path("/y"))
    w0 = _feed(src, 0.0, 15.0, 0.0)
    _feed(dst, 16.0, 30.0, w0)  # stopped at 15 s, running on dst from 16 s
    w.links = {"calm": [calm], "moved": [src, dst]}
    w.ready_at = {"calm": 1.0, "moved": 1.0}
    return w


def test_a_guest_stopped_for_a_second_loses_a_second_and_shows_the_pause() -> None:
    got = _watch().summary(10.0, 25.0)
    moved, calm = got["vms"]["moved"], got["vms"]["calm"]
    assert moved["hosts"] == ["src", "dst"]
    assert moved["guest_pause_ms"] == pytest.approx(1050.0, abs=60.0)
    assert moved["work_lost_s"] == pytest.approx(1.0, abs=0.3)
    assert moved["seconds_below_10pct"] == pytest.approx(1.0, abs=0.3)
    # the guest that never moved lost nothing and paused for no more than a beat
    assert calm["work_lost_s"] == pytest.approx(0.0, abs=0.1)
    assert calm["guest_pause_ms"] < 100.0
    assert got["work_lost_worst_s"] == moved["work_lost_s"]
    assert got["work_lost_sum_s"] == pytest.approx(moved["work_lost_s"] + calm["work_lost_s"])
    assert got["guest_pause_worst_ms"] == moved["guest_pause_ms"] and got["measured"] == 2
    # unclipped, the steady guest's noise cancels and the stopped second remains
    assert moved["work_lost_net_s"] == pytest.approx(1.0, abs=0.3)
    assert abs(calm["work_lost_net_s"]) < 0.1
    assert got["work_lost_net_sum_s"] == pytest.approx(
        moved["work_lost_net_s"] + calm["work_lost_net_s"])


def test_the_unclipped_figure_of_a_run_recorded_without_it() -> None:
    vm = {"baseline_rate": 100.0, "series": [[0.0, 100.0], [0.1, 0.0], [0.2, 200.0]]}
    assert net_lost(vm) == pytest.approx(0.0)  # the bin above normal paid the stop back
    assert net_lost({**vm, "work_lost_net_s": 0.7}) == 0.7
    assert net_lost({"baseline_rate": None, "series": []}) is None


def test_a_vm_with_no_figures_is_left_out_of_the_totals() -> None:
    t = totals({"a": {"work_lost_s": 2.0, "seconds_below_10pct": 0.5, "guest_pause_ms": 300},
                "b": {"work_lost_s": None, "seconds_below_10pct": None,
                      "guest_pause_ms": None}})
    assert t == {"work_lost_sum_s": 2.0, "work_lost_net_sum_s": None,
                 "work_lost_worst_s": 2.0, "below_10pct_worst_s": 0.5,
                 "guest_pause_worst_ms": 300.0, "measured": 1}
    assert totals({})["work_lost_sum_s"] is None


def test_split_puts_each_vms_loss_before_during_or_after_its_own_migration() -> None:
    from livemig.evacuate.harm import split

    # 1 s bins of 0.1 s each: normal 100; the drain starts 2 s into the window
    series = [[round(0.1 * i, 1), 50.0] for i in range(60)]  # half speed throughout
    vms = {"a": {"baseline_rate": 100.0, "series": series},
           "b": {"baseline_rate": 0.0, "series": series},  # idle: no normal rate, left out
           "c": {"baseline_rate": 100.0, "series": None}}
    records = [{"name": "a", "start_s": 1.0, "end_s": 3.0}, {"name": "b", "start_s": 0.0,
               "end_s": 1.0}, {"name": "c", "start_s": 0.0, "end_s": 1.0}]
    got = split(vms, records, offset=2.0)
    # drain time = t - 2: before its start for t < 3 s, during for 3-5 s, after from 5 s
    assert got == {"before": 1.5, "during": 1.0, "after": 0.5}
    # with the stream's first and last byte, the time during is split at them
    streamed = [{**records[0], "stream_s": [1.5, 2.5]}, *records[1:]]
    assert split(vms, streamed, offset=2.0) == {
        "before": 1.5, "during": 1.0, "after": 0.5,
        "starting": 0.25, "streaming": 0.5, "finishing": 0.25}
    # a rate above normal is no negative loss
    assert split({"a": {"baseline_rate": 10.0, "series": [[0.0, 20.0]]}},
                 [{"name": "a", "start_s": 0.0, "end_s": 1.0}], 0.0)["during"] == 0.0
