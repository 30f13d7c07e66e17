"""Throttle, downtime-ramp and last-resort policies fed with synthetic traces."""

import pytest

from livemig.policy.base import (
    AbortMigration,
    ForceSwitchover,
    RoundTracker,
    SetDowntimeLimit,
    SetThrottle,
    Snapshot,
    StartPostcopy,
    StrategyExhausted,
)
from livemig.policy.convergence import DowntimeRamp, LastResort
from livemig.policy.throttle import ThrottlePolicy, staged_ratio

MB = 1 << 20


def snap(t, rounds, remaining, dirty=100 * MB, bw=50 * MB, thr=0):
    return Snapshot(t=t, rounds=rounds, remaining=remaining, dirty_rate=dirty, bandwidth=bw,
                    throttle_pct=thr, ram_total=1 << 30)


def drive(policy, trace):
    out = []
    for s in trace:
        for a in policy.decide(s):
            out.append((s.t, a))
    return out


def test_round_tracker_stall():
    r = RoundTracker()
    for s in (snap(0, 1, 900 * MB), snap(1, 2, 200 * MB), snap(2, 3, 150 * MB)):
        r.update(s)
    assert not r.stalled()  # 150 vs 200: shrinking by 25 %
    r.update(snap(3, 4, 146 * MB))
    assert r.stalled()  # < 5 % apart
    r.update(snap(4, 5, 100 * MB))
    assert not r.stalled()
    r.update(snap(5, 6, 120 * MB))
    assert r.stalled()  # growing


def test_direct_sequence_90_for_3s_then_99_for_3s_then_exhausted():
    # remaining 100 MB < 5 s x 50 MB/s -> direct
    trace = [snap(0, 1, 900 * MB), snap(1, 2, 100 * MB), snap(2, 3, 99 * MB)]
    trace += [snap(2 + 0.25 * i, 3, 99 * MB) for i in range(1, 40)]
    acts = drive(ThrottlePolicy("reference"), trace)
    kinds = [(t, type(a).__name__, getattr(a, "percent", None)) for t, a in acts]
    assert kinds[0] == (2, "SetThrottle", 90)
    assert kinds[1] == (5.0, "SetThrottle", 99)
    assert kinds[2] == (8.0, "StrategyExhausted", None)
    assert len(kinds) == 3


def test_staged_formula_reading():
    # unthrottled: dirty 500 MB/s vs 50 MB/s link, aim at 10 MB/s -> 98 %
    assert staged_ratio(50 * MB, 500 * MB, 0) == 98
    # already 50 % throttled and still observing 100 MB/s: unthrottled 200 -> 95 %
    assert staged_ratio(50 * MB, 100 * MB, 50) == 95
    # observed rate already below the target: the formula asks for less than before
    assert staged_ratio(50 * MB, 5 * MB, 60) == 20


def test_staged_grows_each_stalled_round_caps_at_99_then_exhausts():
    # remaining 800 MB >> 5 s x 50 MB/s -> staged
    p = ThrottlePolicy("reference")
    seq = [snap(0, 1, 1000 * MB, dirty=60 * MB), snap(1, 2, 800 * MB, dirty=60 * MB),
           snap(2, 3, 800 * MB, dirty=60 * MB)]
    acts = drive(p, seq)
    # 1 - 0.2*50/60 = 0.833 -> 83 %
    assert [a.percent for _, a in acts] == [83]
    # next stalled round: observed 20 MB/s under 83 %: 1 - (10/20)*0.17 = 0.915, but a
    # round that still does not shrink gets at least prev + MIN_STEP = 93
    acts = drive(p, [snap(3, 4, 800 * MB, dirty=20 * MB)])
    assert [a.percent for _, a in acts] == [93]
    # formula gives less than +10: still at least prev + MIN_STEP, capped at 99
    acts = drive(p, [snap(4, 5, 800 * MB, dirty=2 * MB)])
    assert [a.percent for _, a in acts] == [99]
    acts = drive(p, [snap(5, 5, 800 * MB), snap(6.9, 5, 800 * MB)])  # 99 % since t=4
    assert acts == []
    acts = drive(p, [snap(7.0, 6, 800 * MB)])
    assert len(acts) == 1 and isinstance(acts[0][1], StrategyExhausted)
    assert drive(p, [snap(9, 7, 800 * MB)]) == []


def test_converging_migration_is_left_alone():
    p = ThrottlePolicy("reference")
    trace = [snap(i, i + 1, (1000 - 200 * i) * MB) for i in range(5)]
    assert drive(p, trace) == []


def test_forced_modes():
    big = [snap(0, 1, 900 * MB), snap(1, 2, 800 * MB), snap(2, 3, 800 * MB)]
    acts = drive(ThrottlePolicy("direct"), big)
    assert isinstance(acts[0][1], SetThrottle) and acts[0][1].percent == 90
    small = [snap(0, 1, 900 * MB), snap(1, 2, 100 * MB), snap(2, 3, 100 * MB)]
    acts = drive(ThrottlePolicy("staged"), small)
    assert acts[0][1].reason.startswith("staged")
    with pytest.raises(ValueError):
        ThrottlePolicy("gentle")


def test_downtime_ramp_steps_to_ceiling():
    p = DowntimeRamp(start_ms=300, max_ms=1000)
    trace = [snap(0, 1, 900 * MB)] + [snap(i, i + 1, 500 * MB) for i in range(1, 8)]
    limits = [a.ms for _, a in drive(p, trace) if isinstance(a, SetDowntimeLimit)]
    assert limits == [450, 675, 1000]


@pytest.mark.parametrize(("mode", "kind"), [
    ("force", ForceSwitchover), ("abort", AbortMigration), ("postcopy", StartPostcopy)])
def test_last_resort(mode, kind):
    lr = LastResort(mode)
    acts = lr.react(StrategyExhausted("x"), snap(0, 5, MB))
    assert isinstance(acts[0], kind)
    assert lr.react(StrategyExhausted("x"), snap(1, 6, MB)) == []


def test_executor_survives_a_migration_that_ended_under_it():
    import asyncio

    from livemig.engine.executor import PolicyConfig, PolicyExecutor
    from livemig.engine.qmpactuator import QmpActuator
    from livemig.errors import VMError

    events = []

    async def refusing(*_args, **_kw):
        raise VMError("src: set-cpu-throttle: no outgoing migration is running")

    c = PolicyExecutor(PolicyConfig(throttle="reference"), QmpActuator(refusing),
                       lambda what, data: events.append(what))
    trace = [snap(0, 1, 900 * MB), snap(1, 2, 100 * MB), snap(2, 3, 99 * MB)]

    async def run():
        for s in trace:
            await c.tick(s)

    asyncio.run(run())
    assert "action SetThrottle" in events and "action not applied" in events


def test_executor_turns_actions_into_one_decision():
    from livemig.engine.decision import Decision
    from livemig.engine.executor import verdict
    from livemig.policy.base import SetDowntimeLimit

    assert verdict([SetDowntimeLimit("x", 450)]).decision is Decision.CONTINUE
    v = verdict([SetDowntimeLimit("x", 450), AbortMigration("give up"),
                 ForceSwitchover("force")])
    assert (v.decision, v.reason) == (Decision.CANCEL, "give up")
    assert verdict([StartPostcopy("pc")]).decision is Decision.POSTCOPY
    assert verdict([ForceSwitchover("f")]).decision is Decision.FORCE
