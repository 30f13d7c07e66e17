"""Disk-side policies and pinning fed with synthetic traces: exact actions and timing."""

from __future__ import annotations

import asyncio

import pytest

from livemig.engine.actuator import DiskTargets
from livemig.engine.executor import PolicyConfig, PolicyExecutor
from livemig.engine.qmpactuator import QmpActuator
from livemig.policy import pinning
from livemig.policy.base import SetIoThrottle, SetMirrorSpeed, SetRamBandwidth, Snapshot
from livemig.policy.disk import (
    FLOOR,
    MAX_DISK_SHARE,
    MIN_DISK_SHARE,
    IoQos,
    LinkShare,
    choose_granularity,
)

MB = 1 << 20
LINK = 110 * MB


def snap(t, disk_remaining, ready=True, dirty=0.0, write=0.0):
    return Snapshot(t=t, rounds=1, remaining=100 * MB, dirty_rate=0, bandwidth=0,
                    disk_remaining=disk_remaining, disk_total=256 * MB, disk_ready=ready,
                    disk_dirty_rate=dirty, disk_write_rate=write)


def test_link_share_waits_for_the_first_pass():
    p = LinkShare(LINK)
    assert p.decide(snap(0.0, 200 * MB, ready=False)) == []


def test_link_share_gives_ram_a_growing_share_as_the_disk_backlog_shrinks():
    p = LinkShare(LINK)
    big = p.decide(snap(1.0, 200 * MB, dirty=4 * MB))
    speeds = {type(a): a for a in big}
    assert speeds[SetMirrorSpeed].bytes_per_s == int(MAX_DISK_SHARE * LINK)  # capped
    assert speeds[SetRamBandwidth].bytes_per_s == LINK - int(MAX_DISK_SHARE * LINK)
    small = p.decide(snap(2.0, 2 * MB, dirty=4 * MB))
    speeds = {type(a): a for a in small}
    # 2 MiB / 2 s + 4 MiB/s * 1.5 = 7 MiB/s: above the 5% floor (5.5 MiB/s)
    assert speeds[SetMirrorSpeed].bytes_per_s == 7 * MB
    assert speeds[SetRamBandwidth].bytes_per_s == LINK - 7 * MB
    idle = p.decide(snap(3.0, 0, dirty=0))
    assert {type(a): a for a in idle}[SetMirrorSpeed].bytes_per_s == int(MIN_DISK_SHARE * LINK)
    # nothing moved: nothing re-issued
    assert p.decide(snap(4.0, 0, dirty=0)) == []


def test_link_share_never_exceeds_an_explicit_bandwidth():
    p = LinkShare(LINK, ram_cap=24 * MB)
    acts = {type(a): a for a in p.decide(snap(1.0, 0))}
    assert acts[SetRamBandwidth].bytes_per_s == 24 * MB


def test_io_qos_caps_then_steps_down_then_stops_at_the_floor():
    p = IoQos(window_s=2.0)
    write = 8 * MB
    trace = [snap(t, 50 * MB, write=write) for t in (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0,
                                                       10.0, 12.0, 14.0, 16.0, 18.0)]
    caps = []
    for s in trace:
        caps += [(s.t, a.write_bytes_per_s) for a in p.decide(s) if isinstance(a, SetIoThrottle)]
    assert caps[0] == (2.0, 4 * MB)  # first window without shrinking: half the write rate
    assert caps[1] == (4.0, 2 * MB)
    assert caps[2] == (6.0, 1 * MB)
    assert caps[3] == (8.0, 512 << 10)
    assert caps[4] == (10.0, FLOOR)
    assert len(caps) == 5  # at the floor: no more steps


def test_io_qos_leaves_a_shrinking_disk_alone():
    p = IoQos(window_s=2.0)
    out = []
    for t, rem in ((0.0, 50 * MB), (2.0, 30 * MB), (4.0, 10 * MB), (6.0, 0)):
        out += p.decide(snap(t, rem, write=8 * MB))
    assert out == []


def test_io_qos_ignores_a_small_backlog_that_wobbles():
    p = IoQos(window_s=2.0)
    out = []
    for t, rem in ((0.0, 100 << 10), (2.0, 800 << 10), (4.0, 2 * MB), (6.0, 6 * MB)):
        out += p.decide(snap(t, rem, write=8 * MB))
    assert out == []


def test_io_qos_ignores_a_guest_that_hardly_writes():
    p = IoQos(window_s=1.0)
    out = p.decide(snap(0.0, 50 * MB, write=100)) + p.decide(snap(1.0, 50 * MB, write=100))
    assert out == []


@pytest.mark.parametrize("wr_bytes,ops,gran", [
    (4096 * 100, 100, 4 << 10), (8192 * 100, 100, 8 << 10), (65536 * 10, 10, 64 << 10),
    (6000 * 10, 10, 8 << 10), (16 << 20, 2, 1 << 20), (0, 0, 64 << 10), (512, 1, 4 << 10)])
def test_granularity_follows_the_write_size(wr_bytes, ops, gran):
    assert choose_granularity(wr_bytes, ops) == gran


def test_pinning_auto_needs_a_spare_cpu():
    plan, why = pinning.plan([0, 1], vcpus=1, mode="auto")
    assert plan is None and "no spare host CPU" in why
    plan, why = pinning.plan([0, 1, 2, 3], vcpus=1, mode="auto")
    assert plan is not None
    assert plan.migration_cpus == {2, 3} and plan.vcpu_cpus == {0, 1}
    plan, _ = pinning.plan([0, 1, 2, 3, 4, 5, 6, 7], vcpus=2, mode="auto")
    assert plan is not None and plan.migration_cpus == {6, 7}


def test_pinning_on_and_off():
    plan, _ = pinning.plan([0, 1], vcpus=1, mode="on")
    assert plan is not None and plan.migration_cpus == {1} and plan.vcpu_cpus == {0}
    assert pinning.plan([0, 1, 2, 3], vcpus=1, mode="off")[0] is None
    assert pinning.plan([0], vcpus=1, mode="on")[0] is None
    assert pinning.is_vcpu_thread("CPU 0/TCG") and pinning.is_vcpu_thread("CPU 3/KVM")
    assert not pinning.is_vcpu_thread("live_migration")


def test_executor_applies_disk_actions_and_removes_the_io_cap():
    asyncio.run(_executor_disk_actions())


async def _executor_disk_actions():
    calls = []

    async def cmd(command, **args):
        calls.append((command, args))
        return {}

    settings = {"throttle": "off", "disk-schedule": "first", "io-qos": True,
                "on-stall": "force"}
    c = PolicyExecutor(PolicyConfig.from_settings(settings, 300, disk_link=LINK),
                       QmpActuator(cmd, DiskTargets("livemig-mirror", "vdisk0")),
                       lambda *a: None)
    assert [p.name for p in c.policies] == ["disk-first", "io-qos"]
    await c.apply(SetMirrorSpeed("x", 5 * MB))
    await c.apply(SetRamBandwidth("x", 100 * MB))
    await c.apply(SetIoThrottle("x", 2 * MB))
    await c.release()
    assert calls[0] == ("block-job-set-speed", {"device": "livemig-mirror", "speed": 5 * MB})
    assert calls[1] == ("migrate-set-parameters", {"max-bandwidth": 100 * MB})
    assert calls[2][0] == "block_set_io_throttle" and calls[2][1]["bps_wr"] == 2 * MB
    assert calls[3][0] == "block_set_io_throttle" and calls[3][1]["bps_wr"] == 0
