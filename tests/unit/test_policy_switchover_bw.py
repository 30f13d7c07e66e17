"""The switchover-bandwidth policy (policy/convergence.py) on snapshots, and its way
through the executor to the actuator and the converge throttle."""

from __future__ import annotations

import asyncio

from livemig.engine.executor import PolicyConfig, PolicyExecutor
from livemig.policy.base import SetRamBandwidth, SetSwitchoverBandwidth, Snapshot
from livemig.policy.convergence import SwitchoverBandwidth

MB = 1 << 20


def snap(t: float, rounds: int, bandwidth: float) -> Snapshot:
    return Snapshot(t=t, rounds=rounds, remaining=100 * MB, dirty_rate=0,
                    bandwidth=bandwidth)


def test_set_once_after_the_first_pass_to_its_median_wire_rate() -> None:
    p = SwitchoverBandwidth()
    # a slow start, a busy pass, a poll with no figure yet
    for t, bw in enumerate([0.0, 5 * MB, 48 * MB, 50 * MB, 49 * MB]):
        assert p.decide(snap(t, 1, bw)) == []
    acts = p.decide(snap(6, 2, 0.03 * MB))
    assert len(acts) == 1 and isinstance(acts[0], SetSwitchoverBandwidth)
    assert acts[0].bytes_per_s == int(48.5 * MB)  # the median of 5, 48, 49, 50 MiB/s
    assert "4 polls" in acts[0].reason
    assert p.decide(snap(7, 3, 0.01 * MB)) == []  # once


def test_never_above_an_explicit_bandwidth_and_nothing_without_a_figure() -> None:
    p = SwitchoverBandwidth(cap=20 * MB)
    p.decide(snap(0, 1, 30 * MB))
    (a,) = p.decide(snap(1, 2, 30 * MB))
    assert isinstance(a, SetSwitchoverBandwidth) and a.bytes_per_s == 20 * MB
    q = SwitchoverBandwidth()
    assert q.decide(snap(0, 2, 30 * MB)) == []  # no pass seen (attached late)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def set_throttle(self, percent: int, lease_ms: int) -> None:
        self.calls.append(("throttle", percent))

    async def set_downtime(self, ms: int) -> None:
        self.calls.append(("downtime", ms))

    async def set_ram_bandwidth(self, bytes_per_s: int) -> None:
        self.calls.append(("bandwidth", bytes_per_s))

    async def set_switchover_bandwidth(self, bytes_per_s: int) -> None:
        self.calls.append(("switchover", bytes_per_s))

    async def start_postcopy(self) -> None:
        self.calls.append(("postcopy", 0))

    async def set_mirror_speed(self, bytes_per_s: int) -> None:
        self.calls.append(("mirror", bytes_per_s))

    async def set_io_throttle(self, write_bytes_per_s: int) -> None:
        self.calls.append(("io", write_bytes_per_s))


def test_the_executor_runs_it_from_the_setting_and_tells_the_throttle() -> None:
    rec = Recorder()
    cfg = PolicyConfig.from_settings({"throttle": "converge", "switchover-bandwidth": True},
                                     300)
    ex = PolicyExecutor(cfg, rec, lambda w, d: None)
    assert [p.name for p in ex.policies] == ["throttle-converge", "switchover-bandwidth"]

    async def run() -> None:
        await ex.tick(snap(0, 1, 40 * MB))
        await ex.tick(snap(1, 2, 40 * MB))
        # a link share lowering the stream's cap lowers the switchover rate with it
        await ex.apply(SetRamBandwidth("share", 10 * MB))
        await ex.apply(SetRamBandwidth("share", 30 * MB))

    asyncio.run(run())
    assert ("switchover", 40 * MB) in rec.calls
    assert rec.calls[-3:] == [("bandwidth", 10 * MB), ("switchover", 10 * MB),
                              ("bandwidth", 30 * MB)]
    assert ex.converge is not None and ex.converge.switchover_w == 10 * MB
    off = PolicyExecutor(PolicyConfig.from_settings({"throttle": "converge"}, 300), rec,
                         lambda w, d: None)
    assert [p.name for p in off.policies] == ["throttle-converge"]
