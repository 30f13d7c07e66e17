"""The QMP actuator: the executor's actions on a source QEMU the engine talks to
directly (lab and attach runs).

The throttle is the patched QEMU's ``set-cpu-throttle`` lease (``cancel-cpu-throttle``
drops it; either leaves auto-converge's own throttle alone); the disk policies act on
the caller's copy job and guest disk (:class:`~livemig.engine.actuator.DiskTargets`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from livemig.engine.actuator import DiskTargets, NotApplied, compression_params
from livemig.engine.executor import POLICY_THROTTLES, SWITCHOVER_BW
from livemig.errors import UsageError, VMError

THROTTLE_SET = "set-cpu-throttle"
THROTTLE_CANCEL = "cancel-cpu-throttle"

Command = Callable[..., Awaitable[Any]]


def check_throttle(mode: str, accel: str, commands: Collection[str]) -> None:
    """One-line UsageError when ``throttle=mode`` cannot run on this source."""
    if mode == "dirty-limit" and accel != "kvm":
        raise UsageError("throttle=dirty-limit needs KVM with a dirty ring; this run "
                         f"uses {accel} (use reference, staged or auto-converge)")
    if mode in POLICY_THROTTLES and THROTTLE_SET not in commands:
        raise UsageError(f"throttle={mode} needs the patched QEMU's {THROTTLE_SET} "
                         "command; this QEMU lacks it")


class QmpActuator:
    """``cmd``: the source's QMP command call; ``disk``: the caller's copy job and guest
    disk (None: the disk actions are refused)."""

    def __init__(self, cmd: Command, disk: DiskTargets | None = None) -> None:
        self.cmd = cmd
        self.disk = disk

    async def _try(self, command: str, **args: Any) -> None:
        try:
            await self.cmd(command, **args)
        except VMError as e:
            raise NotApplied(f"{command}: {e}") from None

    async def set_throttle(self, percent: int, lease_ms: int) -> None:
        if percent:
            await self._try(THROTTLE_SET, percent=percent, **{"lease-ms": lease_ms})
        else:
            await self._try(THROTTLE_CANCEL)

    async def set_downtime(self, ms: int) -> None:
        await self._try("migrate-set-parameters", **{"downtime-limit": ms})

    async def set_ram_bandwidth(self, bytes_per_s: int) -> None:
        await self._try("migrate-set-parameters", **{"max-bandwidth": bytes_per_s})

    async def set_switchover_bandwidth(self, bytes_per_s: int) -> None:
        await self._try("migrate-set-parameters", **{SWITCHOVER_BW: bytes_per_s})

    async def set_compression(self, method: str, delta_cache: int = 0) -> None:
        await self._try("migrate-set-parameters", **compression_params(method, delta_cache))

    async def start_postcopy(self) -> None:
        await self._try("migrate-start-postcopy")

    async def set_mirror_speed(self, bytes_per_s: int) -> None:
        if self.disk is None:
            raise NotApplied("no disk copy to set the speed of")
        await self._try("block-job-set-speed", device=self.disk.block_job, speed=bytes_per_s)

    async def set_io_throttle(self, write_bytes_per_s: int) -> None:
        if self.disk is None:
            raise NotApplied("no guest disk named to cap")
        await self._try("block_set_io_throttle", id=self.disk.io_device, bps=0, bps_rd=0,
                        bps_wr=write_bytes_per_s, iops=0, iops_rd=0, iops_wr=0)
