"""The libvirt actuator (virt/actuator.py) with a fake domain and passthrough: which
libvirt call or QMP command each executor action becomes (pure logic)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from livemig.engine.actuator import NotApplied
from livemig.engine.executor import PolicyConfig, PolicyExecutor
from livemig.policy.base import SetDowntimeLimit, SetIoThrottle, SetThrottle, Snapshot
from livemig.virt.actuator import IoDevice, LibvirtActuator, io_devices
from livemig.virt.conn import LibvirtError

MB = 1 << 20


class FakeLibvirtError(Exception):
    pass


class FakeDomain:
    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.refuse = refuse

    def _call(self, name: str, *args: Any) -> int:
        self.calls.append((name, args))
        if self.refuse:
            raise FakeLibvirtError("Requested operation is not valid: no job is active")
        return 0

    def migrateSetMaxDowntime(self, ms: int, flags: int) -> int:
        return self._call("migrateSetMaxDowntime", ms, flags)

    def migrateSetMaxSpeed(self, mib: int, flags: int) -> int:
        return self._call("migrateSetMaxSpeed", mib, flags)

    def migrateStartPostCopy(self, flags: int) -> int:
        return self._call("migrateStartPostCopy", flags)


class FakeQmp:
    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.refuse = refuse

    def __call__(self, execute: str, **args: Any) -> Any:
        self.calls.append((execute, args))
        if execute in self.refuse:
            raise LibvirtError(f"{execute}: refused")
        return {}


VDA = IoDevice("vda", "/machine/peripheral/virtio-disk0/virtio-backend")


def _act(knob: str | None = "command", io: tuple[IoDevice, ...] = (VDA,),
         refuse: frozenset[str] = frozenset(), dom_refuses: bool = False
         ) -> tuple[LibvirtActuator, FakeDomain, FakeQmp]:
    dom, q = FakeDomain(dom_refuses), FakeQmp(refuse)
    return LibvirtActuator(dom, q, FakeLibvirtError, knob, io), dom, q


def test_libvirt_names_what_it_has_and_the_rest_goes_by_passthrough() -> None:
    act, dom, q = _act()

    async def run() -> None:
        await act.set_downtime(600)
        await act.set_ram_bandwidth(3 * MB + 1)
        await act.start_postcopy()
        await act.set_throttle(45, 1000)
        await act.set_throttle(0, 1000)
        await act.set_io_throttle(2 * MB)
        await act.set_io_throttle(0)

    asyncio.run(run())
    assert dom.calls == [("migrateSetMaxDowntime", (600, 0)), ("migrateSetMaxSpeed", (4, 0)),
                         ("migrateStartPostCopy", (0,))]
    assert act.downtime_set
    io = {"id": VDA.qdev, "bps": 0, "bps_rd": 0, "iops": 0, "iops_rd": 0, "iops_wr": 0}
    assert q.calls == [("set-cpu-throttle", {"percent": 45, "lease-ms": 1000}),
                       ("cancel-cpu-throttle", {}),
                       ("block_set_io_throttle", {**io, "bps_wr": 2 * MB}),
                       ("block_set_io_throttle", {**io, "bps_wr": 0})]


def test_throttle_as_a_parameter_on_an_older_build() -> None:
    act, _, q = _act(knob="parameter")
    asyncio.run(act.set_throttle(30, 1000))
    assert q.calls == [("migrate-set-parameters",
                        {"cpu-throttle-direct": 30, "cpu-throttle-lease-ms": 1000})]


def test_refusals_are_not_applied() -> None:
    act, _, _ = _act(knob=None, io=(), dom_refuses=True)
    for call, match in ((act.set_throttle(30, 1000), "no direct throttle"),
                        (act.set_downtime(500), "migrateSetMaxDowntime: Requested"),
                        (act.set_mirror_speed(MB), "libvirt drives the disk copy"),
                        (act.set_io_throttle(MB), "no copied disk")):
        with pytest.raises(NotApplied, match=match):
            asyncio.run(call)
    assert not act.downtime_set
    act, _, _ = _act(refuse=frozenset({"block_set_io_throttle"}))
    with pytest.raises(NotApplied, match="vda: block_set_io_throttle: refused"):
        asyncio.run(act.set_io_throttle(MB))


def test_executor_through_the_libvirt_actuator() -> None:
    """The same executor as lab runs: lease renewed each poll, IO cap off at the end."""
    act, dom, q = _act()
    events: list[str] = []
    ex = PolicyExecutor(PolicyConfig(), act, lambda w, d: events.append(w))

    class Script:
        name = "script"

        def __init__(self) -> None:
            self.ticks: list[list[Any]] = [
                [SetThrottle("dirty", 50), SetIoThrottle("disk lags", MB)],
                [SetDowntimeLimit("ramp", 450)]]

        def decide(self, s: Snapshot) -> list[Any]:
            return self.ticks.pop(0) if self.ticks else []

    ex.policies = [Script()]
    s = Snapshot(t=1, rounds=2, remaining=MB, dirty_rate=0, bandwidth=MB)

    async def run() -> None:
        await ex.tick(s)
        await ex.tick(s)
        await ex.release()

    asyncio.run(run())
    names = [c[0] for c in q.calls]
    assert names == ["set-cpu-throttle", "block_set_io_throttle", "set-cpu-throttle",
                     "cancel-cpu-throttle", "block_set_io_throttle"]
    assert q.calls[-1][1]["bps_wr"] == 0
    assert dom.calls == [("migrateSetMaxDowntime", (450, 0))]
    assert events[:3] == ["action SetThrottle", "action SetIoThrottle", "action SetDowntimeLimit"]


QUERY_BLOCK = [
    {"device": "", "qdev": "/machine/peripheral/virtio-disk0/virtio-backend",
     "inserted": {"node-name": "libvirt-1-format", "bps": 0, "bps_wr": 0, "iops": 0}},
    {"device": "", "qdev": "/machine/peripheral/virtio-disk1/virtio-backend",
     "inserted": {"node-name": "libvirt-2-format", "bps_wr": 10 * MB}},
    {"device": "", "qdev": "scsi0-0-0-0", "inserted": {"node-name": "libvirt-3-format"}},
]


def test_io_devices_from_query_block() -> None:
    found, why = io_devices(QUERY_BLOCK, {"vda": "virtio-disk0", "vdb": "virtio-disk1",
                                          "sda": "scsi0-0-0-0", "vdc": "virtio-disk9"},
                            ("vda", "vdb", "sda", "vdc", "vdd"))
    assert found == [IoDevice("vda", "/machine/peripheral/virtio-disk0/virtio-backend"),
                     IoDevice("sda", "scsi0-0-0-0")]
    assert why == ["vdb: has I/O tuning of its own (left as it is)",
                   "vdc: no block device of the source's QEMU is virtio-disk9",
                   "vdd: no block device of the source's QEMU is ?"]
