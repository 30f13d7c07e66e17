"""The switchover-bandwidth policy (policy/convergence.py) on snapshots, and its way
through the executor to the actuator and the converge throttle."""

from __future__ import annotations

import asyncio

from livemig.engine.executor import PolicyConfig, PolicyExecutor
from livemig.policy.base import SetRamBandwidth, SetSwitchoverBandwidth, Snapshot
from livemig.policy.convergence import WINDOW, SwitchoverBandwidth

MB = 1 << 20


def snap(t: float, rounds: int, bandwidth: float, remaining: int = 100 * MB) -> Snapshot:
    return Snapshot(t=t, rounds=rounds, remaining=remaining, dirty_rate=0,
                    bandwidth=bandwidth)


def test_set_after_the_first_pass_to_the_median_of_its_busy_polls() -> None:
    p = SwitchoverBandwidth()
    # a slow start, a busy pass, a poll with no figure yet
    for t, bw in enumerate([0.0, 5 * MB, 48 * MB, 50 * MB, 49 * MB]):
        assert p.decide(snap(t / 4, 1, bw)) == []
    acts = p.decide(snap(1.25, 2, 47 * MB))
    assert len(acts) == 1 and isinstance(acts[0], SetSwitchoverBandwidth)
    assert acts[0].bytes_per_s == 48 * MB  # the median of 5, 48, 49, 50, 47 MiB/s
    assert "first pass over" in acts[0].reason
    # the tail: a few pages a round, QEMU's rate near zero; those polls are not busy
    for k in range(3, 20):
        assert p.decide(snap(1.25 + k / 4, k, 0.03 * MB, remaining=120 << 10)) == []


def test_a_first_pass_held_back_and_then_let_go_is_told_its_new_rate() -> None:
    """An evacuation's link share held this stream at ~1 MiB/s for most of its first
    pass, then gave it 12 MiB/s: QEMU must not switch over as if it still crawled."""
    p = SwitchoverBandwidth()
    t = 0.0
    for _ in range(80):
        t += 0.25
        p.decide(snap(t, 1, 1.1 * MB))
    for _ in range(WINDOW):
        t += 0.25
        p.decide(snap(t, 1, 12 * MB))
    (a,) = p.decide(snap(t + 0.25, 2, 12 * MB))
    assert isinstance(a, SetSwitchoverBandwidth) and a.bytes_per_s == 12 * MB
    # and lowered again when the share takes it back (a move of more than 20 %)
    acts = []
    for k in range(WINDOW):
        acts += p.decide(snap(t + 0.5 + k / 4, 3, 4 * MB))
    told = [x.bytes_per_s for x in acts if isinstance(x, SetSwitchoverBandwidth)]
    assert told[-1] == 4 * MB and len(told) <= 2 and "moved" in acts[-1].reason


def test_never_above_an_explicit_bandwidth_and_nothing_without_a_figure() -> None:
    p = SwitchoverBandwidth(cap=20 * MB)
    p.decide(snap(0, 1, 30 * MB))
    p.decide(snap(0.25, 1, 30 * MB))
    (a,) = p.decide(snap(0.5, 2, 30 * MB))
    assert isinstance(a, SetSwitchoverBandwidth) and a.bytes_per_s == 20 * MB
    q = SwitchoverBandwidth()
    assert q.decide(snap(0, 2, 30 * MB)) == []  # one poll: no interval to judge it by


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
        await ex.tick(snap(0.25, 1, 40 * MB))
        await ex.tick(snap(0.5, 2, 40 * MB))
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


def resend(t: float, rounds: int, wire: float, page: float, pct: int = 0,
           remaining: int = 100 * MB) -> Snapshot:
    return Snapshot(t=t, rounds=rounds, remaining=remaining, dirty_rate=0, bandwidth=wire,
                    throttle_pct=pct, page_rate=page)


def test_a_throttled_guest_gets_the_rate_its_pages_drain_at_and_loses_it_after() -> None:
    """lz4 deltas of small rewrites: 12 MiB/s on the wire carried ~140 MiB/s of pages
    (docs/results/handstarted-2026-11-29e/slowdb). At the wire rate QEMU switched over
    15 ms into a 1000 ms limit, after the guest had spent 3.4 s below 10 %."""
    p = SwitchoverBandwidth(cap=12 * MB)
    # the first pass: zero pages inflate its page rate; they are not a re-send's
    for k in range(4):
        assert p.decide(resend(k / 4, 1, 12 * MB, 900 * MB)) == []
    (a,) = p.decide(resend(1.0, 2, 12 * MB, 140 * MB))
    assert isinstance(a, SetSwitchoverBandwidth)
    assert a.bytes_per_s == 12 * MB and not a.guest_bytes  # unthrottled: the wire's
    for k in range(3):
        assert p.decide(resend(1.25 + k / 4, 2, 12 * MB, 140 * MB, pct=30)) == []
    (b,) = p.decide(resend(2.0, 3, 12 * MB, 140 * MB, pct=90))
    assert isinstance(b, SetSwitchoverBandwidth) and b.guest_bytes
    assert b.bytes_per_s == 140 * MB and "the guest is throttled" in b.reason
    (c,) = p.decide(resend(2.25, 3, 12 * MB, 140 * MB, pct=0))
    assert isinstance(c, SetSwitchoverBandwidth) and not c.guest_bytes
    assert c.bytes_per_s == 12 * MB and "the throttle is off" in c.reason


def test_the_guest_byte_rate_follows_a_lowered_cap_by_the_compression_ratio() -> None:
    p = SwitchoverBandwidth(cap=6 * MB, full=lambda s: True)
    p.decide(resend(0, 2, 12 * MB, 120 * MB))
    (a,) = p.decide(resend(0.25, 2, 12 * MB, 120 * MB))
    # 10 page bytes per wire byte, the wire held to 6 MiB/s: 60 MiB/s of pages at most
    assert a.guest_bytes and a.bytes_per_s == 60 * MB


def test_the_converge_throttle_asks_for_it_and_keeps_its_wire_rate() -> None:
    rec = Recorder()
    cfg = PolicyConfig.from_settings({"throttle": "converge", "switchover-bandwidth": True},
                                     300)
    ex = PolicyExecutor(cfg, rec, lambda w, d: None)
    assert ex.converge is not None

    async def run() -> None:
        # a first pass, then re-send rounds the guest outruns: 10:1 compression
        await ex.tick(resend(0, 1, 12 * MB, 12 * MB, remaining=900 * MB))
        await ex.tick(resend(2.0, 1, 12 * MB, 12 * MB, remaining=300 * MB))
        await ex.tick(resend(4.0, 2, 12 * MB, 120 * MB, remaining=250 * MB))
        await ex.tick(resend(4.25, 2, 12 * MB, 120 * MB, remaining=240 * MB))
        await ex.tick(resend(6.2, 3, 12 * MB, 120 * MB, remaining=245 * MB))
        # a cap from a link share leaves a guest-byte rate to the policy
        await ex.apply(SetRamBandwidth("share", 6 * MB))

    asyncio.run(run())
    told = [v for what, v in rec.calls if what == "switchover"]
    assert told[0] == 12 * MB and told[-1] == 120 * MB
    assert ex.converge.full_budget and ex.switchover_guest
    assert ex.converge.switchover_w == 12 * MB  # the wire rate its next plans compare
    assert rec.calls[-1] == ("bandwidth", 6 * MB)
