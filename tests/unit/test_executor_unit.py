"""The policy executor (engine/executor.py) with a recording actuator, and the QMP
actuator's commands (pure logic: no QEMU)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from livemig.engine.actuator import DiskTargets, NotApplied
from livemig.engine.decision import Decision
from livemig.engine.executor import THROTTLE_LEASE_MS, PolicyConfig, PolicyExecutor
from livemig.engine.qmpactuator import QmpActuator, check_throttle
from livemig.errors import UsageError, VMError
from livemig.policy.base import (
    AbortMigration,
    SetDowntimeLimit,
    SetIoThrottle,
    SetThrottle,
    Snapshot,
    StartPostcopy,
)

MB = 1 << 20


class Recorder:
    """An actuator that records its calls; ``refuse`` names calls it refuses."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.refuse = refuse

    def _call(self, name: str, *args: int) -> None:
        self.calls.append((name, args))
        if name in self.refuse:
            raise NotApplied(f"{name}: refused")

    async def set_throttle(self, percent: int, lease_ms: int) -> None:
        self._call("throttle", percent, lease_ms)

    async def set_downtime(self, ms: int) -> None:
        self._call("downtime", ms)

    async def set_ram_bandwidth(self, bytes_per_s: int) -> None:
        self._call("bandwidth", bytes_per_s)

    async def set_switchover_bandwidth(self, bytes_per_s: int) -> None:
        self._call("switchover", bytes_per_s)

    async def set_compression(self, method: str, delta_cache: int = 0) -> None:
        args = (method, delta_cache) if delta_cache else (method,)
        self.calls.append(("compression", args))  # type: ignore[arg-type]
        if "compression" in self.refuse:
            raise NotApplied("compression: refused")

    async def start_postcopy(self) -> None:
        self._call("postcopy")

    async def set_mirror_speed(self, bytes_per_s: int) -> None:
        self._call("mirror", bytes_per_s)

    async def set_io_throttle(self, write_bytes_per_s: int) -> None:
        self._call("io", write_bytes_per_s)


class Fixed:
    """A policy that returns the actions it is given, once per tick."""

    name = "fixed"

    def __init__(self, *ticks: list[Any]) -> None:
        self.ticks = list(ticks)

    def decide(self, s: Snapshot) -> list[Any]:
        return self.ticks.pop(0) if self.ticks else []


def snap(t: float = 1.0) -> Snapshot:
    return Snapshot(t=t, rounds=1, remaining=100 * MB, dirty_rate=0, bandwidth=10 * MB)


def _executor(*ticks: list[Any], refuse: frozenset[str] = frozenset(),
              cfg: PolicyConfig | None = None
              ) -> tuple[PolicyExecutor, Recorder, list[tuple[str, dict[str, Any]]]]:
    rec = Recorder(refuse)
    events: list[tuple[str, dict[str, Any]]] = []
    ex = PolicyExecutor(cfg or PolicyConfig(), rec, lambda w, d: events.append((w, d)))
    ex.policies = [Fixed(*ticks)]
    return ex, rec, events


def test_throttle_lease_is_renewed_every_poll_and_released() -> None:
    ex, rec, events = _executor([SetThrottle("dirty", 40)], [], [])

    async def run() -> None:
        for t in range(3):
            assert (await ex.tick(snap(t))).decision is Decision.CONTINUE
        await ex.release()

    asyncio.run(run())
    assert rec.calls == [("throttle", (40, THROTTLE_LEASE_MS))] * 3 + \
        [("throttle", (0, THROTTLE_LEASE_MS))]
    assert events[0] == ("action SetThrottle", {"reason": "dirty", "percent": 40})


def test_nothing_set_nothing_released() -> None:
    ex, rec, _ = _executor([], [])
    asyncio.run(ex.release())
    assert rec.calls == []


def test_a_refusal_is_recorded_not_raised() -> None:
    ex, _, events = _executor([SetDowntimeLimit("ramp", 450)], refuse=frozenset({"downtime"}))
    v = asyncio.run(ex.tick(snap()))
    assert v.decision is Decision.CONTINUE
    assert ("action not applied", {"action": "SetDowntimeLimit",
                                   "error": "downtime: refused"}) in events


def test_io_cap_is_removed_at_the_end() -> None:
    ex, rec, events = _executor([SetIoThrottle("backlog", 2 * MB)])

    async def run() -> None:
        await ex.tick(snap())
        await ex.release()

    asyncio.run(run())
    assert rec.calls == [("io", (2 * MB,)), ("io", (0,))]
    assert ("io cap removed", {}) in events


def test_abort_is_a_verdict_postcopy_is_started() -> None:
    ex, rec, _ = _executor([AbortMigration("give up")], [StartPostcopy("pc")])
    assert asyncio.run(ex.tick(snap())).decision is Decision.CANCEL
    assert rec.calls == []  # the monitor cancels, not the actuator
    assert asyncio.run(ex.tick(snap(2))).decision is Decision.POSTCOPY
    assert rec.calls == [("postcopy", ())]


def test_policies_from_settings() -> None:
    ex = PolicyExecutor(PolicyConfig.from_settings(
        {"throttle": "converge", "downtime-ramp": True, "max-downtime": 2000,
         "disk-schedule": "first", "io-qos": True}, 300), Recorder(), lambda w, d: None)
    # no disk copy: no disk policies
    assert [p.name for p in ex.policies] == ["throttle-converge", "downtime-ramp"]
    ex = PolicyExecutor(PolicyConfig.from_settings(
        {"throttle": "auto-converge", "disk-schedule": "first", "io-qos": True}, 300,
        disk_link=100 * MB), Recorder(), lambda w, d: None)
    assert [p.name for p in ex.policies] == ["disk-first", "io-qos"]
    assert not PolicyExecutor(PolicyConfig(), Recorder(), lambda w, d: None).active


def test_downtime_ramp_tells_the_converge_throttle() -> None:
    ex, rec, _ = _executor([SetDowntimeLimit("ramp", 900)],
                           cfg=PolicyConfig(throttle="converge"))
    assert ex.converge is not None
    asyncio.run(ex.tick(snap()))
    assert ex.converge.downtime_s == pytest.approx(0.9)
    assert rec.calls == [("downtime", (900,))]


# -- the QMP actuator ------------------------------------------------------------------
def _qmp(disk: DiskTargets | None = None, fail: bool = False
         ) -> tuple[QmpActuator, list[tuple[str, dict[str, Any]]]]:
    calls: list[tuple[str, dict[str, Any]]] = []

    async def cmd(command: str, **args: Any) -> Any:
        calls.append((command, args))
        if fail:
            raise VMError(f"src: {command}: no migration")
        return {}

    return QmpActuator(cmd, disk), calls


def test_qmp_actuator_commands() -> None:
    act, calls = _qmp(DiskTargets("job0", "/machine/peripheral/d0/virtio-backend"))

    async def run() -> None:
        await act.set_throttle(30, 1000)
        await act.set_throttle(0, 1000)
        await act.set_downtime(500)
        await act.set_ram_bandwidth(8 * MB)
        await act.set_switchover_bandwidth(40 * MB)
        await act.set_compression("lz4")
        await act.set_compression("lz4", 64 * MB)
        await act.start_postcopy()
        await act.set_mirror_speed(5 * MB)
        await act.set_io_throttle(MB)

    asyncio.run(run())
    assert calls == [
        ("set-cpu-throttle", {"percent": 30, "lease-ms": 1000}),
        ("cancel-cpu-throttle", {}),
        ("migrate-set-parameters", {"downtime-limit": 500}),
        ("migrate-set-parameters", {"max-bandwidth": 8 * MB}),
        ("migrate-set-parameters", {"avail-switchover-bandwidth": 40 * MB}),
        ("migrate-set-parameters", {"multifd-compression": "lz4"}),
        ("migrate-set-parameters", {"x-multifd-lz4-delta-cache-size": 64 * MB,
                                    "multifd-compression": "lz4"}),
        ("migrate-start-postcopy", {}),
        ("block-job-set-speed", {"device": "job0", "speed": 5 * MB}),
        ("block_set_io_throttle", {"id": "/machine/peripheral/d0/virtio-backend", "bps": 0,
                                   "bps_rd": 0, "bps_wr": MB, "iops": 0, "iops_rd": 0,
                                   "iops_wr": 0}),
    ]


def test_qmp_actuator_refusals() -> None:
    act, calls = _qmp(fail=True)
    with pytest.raises(NotApplied, match="set-cpu-throttle: src: set-cpu-throttle"):
        asyncio.run(act.set_throttle(30, 1000))
    with pytest.raises(NotApplied, match="no disk copy"):
        asyncio.run(act.set_mirror_speed(MB))
    with pytest.raises(NotApplied, match="no guest disk"):
        asyncio.run(act.set_io_throttle(MB))
    assert len(calls) == 1  # the disk actions never reached QEMU


def test_check_throttle() -> None:
    check_throttle("converge", "tcg", {"set-cpu-throttle"})
    check_throttle("auto-converge", "tcg", set())
    with pytest.raises(UsageError, match="needs the patched QEMU's set-cpu-throttle"):
        check_throttle("converge", "tcg", {"query-migrate"})
    with pytest.raises(UsageError, match="dirty-limit needs KVM"):
        check_throttle("dirty-limit", "tcg", {"set-cpu-throttle"})


def test_postcopy_after_starts_postcopy_once_at_its_time() -> None:
    from livemig.policy.convergence import PostcopyAfter

    ex = PolicyExecutor(PolicyConfig.from_settings({"postcopy-after": 30.0}, 300),
                        Recorder(), lambda w, d: None)
    assert [p.name for p in ex.policies] == ["postcopy-after"]
    p = PostcopyAfter(30.0)
    assert p.decide(Snapshot(t=29.9, rounds=3, remaining=1 << 20, dirty_rate=0,
                             bandwidth=1e6)) == []
    acts = p.decide(Snapshot(t=30.1, rounds=4, remaining=1 << 20, dirty_rate=0,
                             bandwidth=1e6))
    assert len(acts) == 1 and isinstance(acts[0], StartPostcopy)
    assert "postcopy-after 30 s" in acts[0].reason
    assert p.decide(Snapshot(t=31, rounds=5, remaining=1, dirty_rate=0, bandwidth=1e6)) == []


def test_an_encoding_that_switches_after_the_first_pass_gets_its_switch_once() -> None:
    """zstd+delta: the executor is told by the encoding's record (before the
    migration, or by the deferred choice while it runs) and switches the codec at the
    first poll that sees the first pass over, once; an encoding without a second codec
    adds nothing."""
    ex, rec, events = _executor()
    ex.after_first_pass({"encoding": "zstd"})
    ex.after_first_pass(None)
    assert len(ex.policies) == 1
    enc = {"encoding": "zstd+delta", "after_first_pass": {"multifd-compression": "lz4"}}
    ex.after_first_pass(enc)
    ex.after_first_pass(enc)  # the deferred choice told it again: still one switch
    assert len(ex.policies) == 2

    async def run() -> None:
        for t, rounds in ((1.0, 1), (2.0, 1), (3.0, 2), (4.0, 3), (5.0, 4)):
            await ex.tick(Snapshot(t=t, rounds=rounds, remaining=10 * MB, dirty_rate=0,
                                   bandwidth=10 * MB))

    asyncio.run(run())
    assert rec.calls == [("compression", ("lz4",))]
    assert [w for w, _ in events] == ["action SetCompression"]
    assert events[0][1]["method"] == "lz4" and "first pass over" in events[0][1]["reason"]


def test_the_converge_throttle_hears_of_the_codec_switch_and_when_it_happened() -> None:
    """It waits a round in the new codec before its first decision, and its drain
    rates start again once the switch was applied; a refused switch leaves them."""
    enc = {"encoding": "zstd+delta", "after_first_pass": {"multifd-compression": "lz4"}}
    for refuse, reset in ((frozenset(), True), (frozenset({"compression"}), False)):
        ex, _, _ = _executor(cfg=PolicyConfig(throttle="converge"), refuse=refuse)
        assert ex.converge is not None
        ex.policies = [ex.converge]  # _executor's scripted policy out
        ex.after_first_pass(enc)

        async def run(ex: PolicyExecutor = ex) -> None:
            for t, rounds in ((1.0, 1), (2.0, 1), (3.0, 2)):
                await ex.tick(Snapshot(t=t, rounds=rounds, remaining=400 * MB,
                                       dirty_rate=95 * MB, bandwidth=46 * MB,
                                       page_rate=46 * MB))

        asyncio.run(run())
        assert ex.throttle_pct == 0  # not judged on the first pass's drain
        assert (ex.converge.rate.value is None) is reset


def test_a_refused_delta_fallback_lets_the_next_round_throttle() -> None:
    """The converge throttle's fallback asks for lz4 with a new delta cache instead of
    its first throttle; applied, it measures two rounds (the first fills the cache);
    refused (a QEMU without patch 0019), the next round is judged and throttled."""
    def rounds(refuse: frozenset[str]) -> tuple[list[tuple[str, tuple[object, ...]]],
                                                int]:
        ex, rec, _ = _executor(cfg=PolicyConfig(throttle="converge"), refuse=refuse)
        assert ex.converge is not None
        ex.policies = [ex.converge]
        ex.converge.arm_delta_fallback("lz4", "few rewrites", 64 * MB)

        async def run() -> None:
            await ex.tick(Snapshot(t=0, rounds=1, remaining=1000 * MB, dirty_rate=0,
                                   bandwidth=50 * MB))
            for t, rounds in ((2.0, 2), (4.0, 3)):
                await ex.tick(Snapshot(t=t, rounds=rounds, remaining=200 * MB,
                                       dirty_rate=100 * MB, bandwidth=50 * MB))

        asyncio.run(run())
        return rec.calls, ex.throttle_pct

    calls, pct = rounds(frozenset())
    assert calls[0] == ("compression", ("lz4", 64 * MB)) and pct == 0, calls
    calls, pct = rounds(frozenset({"compression"}))
    assert calls[0] == ("compression", ("lz4", 64 * MB)) and pct > 0, calls
