"""libvirt's job statistics (``virDomainGetJobStats``) in the engine's terms (pure):
the ``query-migrate`` reply QEMU would have given, which the engine's monitor parses
into its :class:`Observation` as for lab and attach runs, and the copied disks'
figures the monitor's hooks hand to the policies and the timeline."""

from __future__ import annotations

from typing import Any

from livemig.engine.observe import DISK_COPY

# not QEMU's: libvirt has started no migration in QEMU yet (it prepares the
# destination: a QEMU started there, its capabilities probed). Not watched for a
# stall: under TCG on a loaded host this alone has taken more than 10 s.
PREPARE = "prepare"


def query_migrate(stats: dict[str, Any] | None, throttle_pct: int = 0,
                  postcopy: bool = False) -> dict[str, Any]:
    """QEMU's ``query-migrate`` reply from libvirt's job statistics of a running job.

    ``status`` is ``prepare`` until libvirt's job has totals, ``disk`` while only the
    disks are copied, ``postcopy-active`` once the source is paused for post-copy,
    ``device`` once nothing is left to send (libvirt's switchover and finish: no
    bytes move then, nothing to watch or decide), else ``active``. No page rate:
    libvirt does not pass QEMU's on, and one derived from its page counters made the
    converge throttle judge the remainder against the pages drained while QEMU's
    switchover threshold is in wire bytes (docs/results/libvirt-2026-11-25); no
    expected downtime either. ``throttle_pct``: the throttle livemig set (the
    patched QEMU's direct one), else libvirt's auto-converge figure."""
    s = stats or {}
    page = int(s.get("memory_page_size") or 4096)
    total = int(s.get("memory_total") or 0)
    disk_total = int(s.get("disk_total") or 0)
    processed = int(s.get("memory_processed") or 0)
    remaining = int(s.get("memory_remaining") or 0)
    if postcopy:
        status = "postcopy-active"
    elif not total and not disk_total:
        status = PREPARE
    elif int(s.get("disk_remaining") or 0) > 0 and not processed:
        status = DISK_COPY
    elif processed and not remaining:
        status = "device"
    else:
        status = "active"
    info: dict[str, Any] = {"status": status}
    if status == PREPARE:
        return info
    bps = float(s.get("memory_bps") or 0)
    info["ram"] = {"transferred": processed, "remaining": remaining, "total": total,
                   "dirty-sync-count": int(s.get("memory_iteration") or 0),
                   "dirty-pages-rate": int(s.get("memory_dirty_rate") or 0),
                   "page-size": page, "mbps": bps * 8 / 1e6}
    info["cpu-throttle-percentage"] = throttle_pct or int(s.get("auto_converge_throttle")
                                                          or 0)
    return info


def disk_observation(stats: dict[str, Any] | None,
                     write_rate: float | None) -> dict[str, Any] | None:
    """The copied disks for the policies' snapshot: the remainder once libvirt copies
    (0 of 0 while it prepares is not a remainder: it would look like a copy that
    grows), and the guest's write rate to them (IO QoS)."""
    s = stats or {}
    out: dict[str, Any] = {}
    if s.get("disk_total"):
        out.update(remaining=int(s.get("disk_remaining") or 0), total=int(s["disk_total"]))
    if write_rate is not None:
        out["write_rate"] = write_rate
    return out or None


def disk_sample(stats: dict[str, Any] | None) -> dict[str, Any]:
    """The timeline's disk columns."""
    s = stats or {}
    return {"remaining_disk": int(s.get("disk_remaining") or 0) if s.get("disk_total")
            else 0, "disk_transferred": int(s.get("disk_processed") or 0)}
