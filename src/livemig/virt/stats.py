"""libvirt's job statistics (``virDomainGetJobStats``) read once per poll: a
policy snapshot, and the engine's :class:`Observation` whose ``sample()`` is the
timeline entry, as in lab and attach runs, plus the copied disk's figures (pure)."""

from __future__ import annotations

from typing import Any

from livemig.engine.observe import Observation
from livemig.policy.base import Snapshot


def snapshot(t: float, stats: dict[str, Any], throttle_pct: int,
             disk_write_rate: float | None = None) -> Snapshot:
    """A policy snapshot from libvirt's job statistics (``disk_write_rate``: bytes/s the
    guest writes to the copied disks, from their block statistics). No page rate:
    libvirt does not pass QEMU's on, and one derived from its page counters made the
    converge throttle judge the remainder against the pages drained while QEMU's
    switchover threshold is in wire bytes (docs/results/libvirt-2026-11-25)."""
    page = int(stats.get("memory_page_size") or 4096)
    return Snapshot(
        t=t,
        rounds=int(stats.get("memory_iteration") or 0),
        remaining=int(stats.get("memory_remaining") or 0),
        dirty_rate=float(stats.get("memory_dirty_rate") or 0) * page,
        bandwidth=float(stats.get("memory_bps") or 0),
        throttle_pct=throttle_pct or int(stats.get("auto_converge_throttle") or 0),
        ram_total=int(stats.get("memory_total") or 0),
        # 0 of 0 while libvirt prepares the copy: not a remainder the disk policies
        # may judge (it would look like a copy that grows)
        disk_remaining=_opt_int(stats.get("disk_remaining")) if stats.get("disk_total")
        else None,
        disk_total=_opt_int(stats.get("disk_total")),
        disk_write_rate=disk_write_rate,
    )


def observation(t: float, stats: dict[str, Any], s: Snapshot) -> Observation:
    """The engine's observation of one poll. ``status`` is ``setup`` while libvirt
    prepares the destination, ``disk`` while only the disks are copied, else
    ``active``; libvirt gives no expected downtime and no page rate."""
    disk_left = s.disk_remaining or 0
    if not s.ram_total and not s.disk_total:
        status = "setup"  # libvirt is still preparing the destination
    elif disk_left > 0 and not stats.get("memory_processed"):
        status = "disk"
    else:
        status = "active"
    return Observation(
        t=round(t, 3), status=status, rounds=s.rounds,
        transferred=int(stats.get("memory_processed") or 0), remaining=s.remaining,
        total=s.ram_total, dirty_rate=s.dirty_rate, bandwidth=s.bandwidth,
        page_rate=0.0, throttle_pct=s.throttle_pct, expected_downtime_ms=None,
        deferred_pages=None, error=None)


def sample_of(t: float, stats: dict[str, Any], s: Snapshot) -> dict[str, Any]:
    """One timeline entry: the observation's sample (the names of a lab run's) and
    the copied disks' remainder and bytes sent."""
    obs = observation(t, stats, s)
    return {**obs.sample(), "remaining_disk": s.disk_remaining or 0,
            "disk_transferred": int(stats.get("disk_processed") or 0),
            "eta_s": (s.remaining / s.bandwidth) if s.bandwidth else None}


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)
