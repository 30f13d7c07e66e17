"""The libvirt actuator: the policy executor's actions on a libvirt domain's source.

What libvirt names goes through libvirt: the downtime limit
(``migrateSetMaxDowntime``), the bandwidth (``migrateSetMaxSpeed``, MiB/s), post-copy
(``migrateStartPostCopy``). The rest goes through the monitor passthrough:

- the patched throttle (``set-cpu-throttle`` lease, or the ``cpu-throttle-direct``
  parameter of an older build);
- the IO cap on the copied disks: ``block_set_io_throttle`` on each disk's device.
  libvirt's own ``setBlockIoTune`` (and ``pinEmulator``/``pinVcpu``) take a modify
  job, which libvirt 9.0 does not allow beside an outgoing migration: measured on the
  testbed, the call waits 30 s for the state change lock and fails. The passthrough
  takes a query job, which it allows. A disk with I/O tuning of its own is left
  alone (livemig would have to restore it exactly); the cap is taken off at the end.

The disk copy's speed is libvirt's (its NBD mirror jobs): refused here, so the
``disk-schedule=first`` link share never runs under libvirt (the plan says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from livemig.engine.actuator import NotApplied, compression_params
from livemig.engine.executor import SWITCHOVER_BW
from livemig.virt.conn import LibvirtError
from livemig.virt.plan import LEASE_PARAM, THROTTLE_CANCEL, THROTTLE_COMMAND, THROTTLE_PARAM, mib

# query-block's throttle fields: all 0 means the disk has no I/O limits of its own
THROTTLE_FIELDS = ("bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr")
NO_IO_LIMITS = dict.fromkeys(THROTTLE_FIELDS, 0)  # block_set_io_throttle: no limit at all

Qmp = Callable[..., Any]  # (execute, **arguments) -> QMP return value (passthrough)


@dataclass(frozen=True)
class IoDevice:
    target: str  # libvirt's target dev (vda)
    qdev: str  # the block backend's device, as block_set_io_throttle names it


def io_devices(query_block: list[dict[str, Any]], aliases: Mapping[str, str],
               targets: tuple[str, ...]) -> tuple[list[IoDevice], list[str]]:
    """The copied disks' devices for the IO cap (``query-block`` of the source, the
    domain's target -> device alias), and why each other one is left alone."""
    found: list[IoDevice] = []
    why: list[str] = []
    for target in targets:
        alias = aliases.get(target)
        entry = None
        if alias:
            entry = next((b for b in query_block
                          if str(b.get("qdev", "")) in (alias, f"/machine/peripheral/{alias}")
                          or f"/machine/peripheral/{alias}/" in str(b.get("qdev", ""))), None)
        if entry is None:
            why.append(f"{target}: no block device of the source's QEMU is {alias or '?'}")
            continue
        inserted = entry.get("inserted") or {}
        if any(int(inserted.get(f) or 0) for f in THROTTLE_FIELDS):
            why.append(f"{target}: has I/O tuning of its own (left as it is)")
            continue
        found.append(IoDevice(target, str(entry["qdev"])))
    return found, why


class LibvirtActuator:
    """``dom``: the source domain; ``qmp``: the passthrough on it; ``throttle_knob``:
    command | parameter | None (the plan's); ``io``: the copied disks to cap."""

    def __init__(self, dom: Any, qmp: Qmp, libvirt_error: type[Exception],
                 throttle_knob: str | None = None, io: tuple[IoDevice, ...] = ()) -> None:
        self.dom = dom
        self.qmp = qmp
        self.libvirt_error = libvirt_error
        self.knob = throttle_knob
        self.io = io
        self.downtime_set = False  # the source's downtime limit is no longer its own

    def _libvirt(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except self.libvirt_error as e:
            raise NotApplied(f"{what}: {e}") from None

    def _passthrough(self, execute: str, **args: Any) -> None:
        try:
            self.qmp(execute, **args)
        except LibvirtError as e:
            raise NotApplied(str(e)) from None

    async def set_throttle(self, percent: int, lease_ms: int) -> None:
        if self.knob == "command":
            if percent:
                self._passthrough(THROTTLE_COMMAND, percent=percent, **{"lease-ms": lease_ms})
            else:
                self._passthrough(THROTTLE_CANCEL)
        elif self.knob == "parameter":
            self._passthrough("migrate-set-parameters",
                              **{THROTTLE_PARAM: percent, LEASE_PARAM: lease_ms})
        else:
            raise NotApplied("the domain's QEMU has no direct throttle")

    async def set_downtime(self, ms: int) -> None:
        self._libvirt("migrateSetMaxDowntime", lambda: self.dom.migrateSetMaxDowntime(ms, 0))
        self.downtime_set = True

    async def set_ram_bandwidth(self, bytes_per_s: int) -> None:
        self._libvirt("migrateSetMaxSpeed",
                      lambda: self.dom.migrateSetMaxSpeed(mib(bytes_per_s), 0))

    async def set_switchover_bandwidth(self, bytes_per_s: int) -> None:
        # libvirt 9.0 has no API for it: the monitor passthrough (the run restores it)
        self._passthrough("migrate-set-parameters", **{SWITCHOVER_BW: bytes_per_s})

    async def set_compression(self, method: str, delta_cache: int = 0) -> None:
        # the codec the passthrough set at the start (the run restores it)
        self._passthrough("migrate-set-parameters", **compression_params(method, delta_cache))

    async def start_postcopy(self) -> None:
        self._libvirt("migrateStartPostCopy", lambda: self.dom.migrateStartPostCopy(0))

    async def set_mirror_speed(self, bytes_per_s: int) -> None:
        raise NotApplied("libvirt drives the disk copy (its NBD mirror) itself")

    async def set_io_throttle(self, write_bytes_per_s: int) -> None:
        if not self.io:
            raise NotApplied("no copied disk to cap")
        errors = []
        for dev in self.io:
            try:
                self.qmp("block_set_io_throttle", id=dev.qdev,
                         **{**NO_IO_LIMITS, "bps_wr": write_bytes_per_s})
            except LibvirtError as e:
                errors.append(f"{dev.target}: {e}")
        if errors:
            raise NotApplied("; ".join(errors))
