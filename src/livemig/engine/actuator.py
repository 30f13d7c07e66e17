"""What the policy executor acts on: the Actuator protocol and the caller's disk.

The executor (:mod:`livemig.engine.executor`) turns policy actions into calls on an
actuator; each entry point brings the one that reaches its VM: the QMP actuator
(:mod:`livemig.engine.qmpactuator`, lab and attach runs, the engine's own ends) or the
libvirt actuator (:mod:`livemig.virt.actuator`, ``--domain`` runs). An actuator raises
:class:`NotApplied` when its end refuses (the migration may have ended since the last
poll): the executor records that, it is not a failure of the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from livemig.errors import LivemigError
from livemig.policy.encoding import DELTA_KEY


class NotApplied(LivemigError):
    """The end refused an action (one line: what and why)."""


def compression_params(method: str, delta_cache: int = 0) -> dict[str, Any]:
    """``migrate-set-parameters`` arguments of a codec switch: the codec, and the new
    delta cache's size when one is made (the cache first: QEMU checks both at once)."""
    if delta_cache:
        return {DELTA_KEY: delta_cache, "multifd-compression": method}
    return {"multifd-compression": method}


@dataclass(frozen=True)
class DiskTargets:
    """What the disk policies act on when the caller copies the disk; the engine knows
    no names of its own (the lab: its mirror job and its guest disk's QOM path)."""

    block_job: str  # the copy's block job id (block-job-set-speed)
    io_device: str  # the guest disk's qdev id or QOM path (block_set_io_throttle)


class Actuator(Protocol):
    """Carries out the executor's actions on one migration's source."""

    async def set_throttle(self, percent: int, lease_ms: int) -> None:
        """Set or renew the patched throttle's lease; 0 cancels it."""

    async def set_downtime(self, ms: int) -> None: ...

    async def set_ram_bandwidth(self, bytes_per_s: int) -> None: ...

    async def set_switchover_bandwidth(self, bytes_per_s: int) -> None:
        """QEMU's avail-switchover-bandwidth (the end puts it back afterwards, as the
        other migration parameters)."""

    async def set_compression(self, method: str, delta_cache: int = 0) -> None:
        """The running stream's multifd codec, and with ``delta_cache`` (bytes) a new
        lz4 delta cache of that size (the end puts both back afterwards, as the other
        migration parameters)."""

    async def start_postcopy(self) -> None: ...

    async def set_mirror_speed(self, bytes_per_s: int) -> None:
        """The disk copy's speed (0: unlimited)."""

    async def set_io_throttle(self, write_bytes_per_s: int) -> None:
        """Cap the guest's disk writes; 0 removes livemig's cap (restores the
        disk's own tuning where the end had one)."""
