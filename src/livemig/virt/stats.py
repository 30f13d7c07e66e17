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


class PageRate:
    """Bytes/s of guest pages the stream moved between two polls: what QMP's
    ``pages-per-second`` × page size says in lab and attach runs (QEMU counts normal,
    zero and xbzrle-encoded pages there). libvirt does not pass that figure on, but
    its job statistics count the same pages, and their growth per second of the
    job's own clock (``time_elapsed``) is the same measure. Unlike ``memory_bps``
    (bytes on the wire) it does not shrink with compression: without it the converge
    throttle took the wire rate as the rate the remainder drains at and throttled a
    zstd stream as if it drained at half its speed (92 % for a whole-page writer
    that converged unthrottled at two at a time, docs/results/evacuate-2026-11-28-d).
    The downtime budget stays in wire bytes, as QEMU's threshold is
    (:mod:`livemig.policy.converge`)."""

    KEYS = ("memory_normal", "memory_constant", "compression_pages")

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None

    def update(self, stats: dict[str, Any]) -> float:
        """The rate since the last call: 0.0 on the first, without a clock or page
        counters, or when they went back (libvirt started a new job)."""
        page = int(stats.get("memory_page_size") or 4096)
        pages = sum(int(stats.get(k) or 0) for k in self.KEYS)
        elapsed = stats.get("time_elapsed")
        if elapsed is None or not pages:
            self._last = None
            return 0.0
        t = float(elapsed) / 1000.0
        last, self._last = self._last, (t, pages)
        if last is None or t <= last[0] or pages < last[1]:
            return 0.0
        return (pages - last[1]) * page / (t - last[0])


def query_migrate(stats: dict[str, Any] | None, throttle_pct: int = 0,
                  postcopy: bool = False, page_rate: float = 0.0) -> dict[str, Any]:
    """QEMU's ``query-migrate`` reply from libvirt's job statistics of a running job.

    ``status`` is ``prepare`` until libvirt's job has totals, ``disk`` while only the
    disks are copied, ``postcopy-active`` once the source is paused for post-copy,
    ``device`` once nothing is left to send (libvirt's switchover and finish: no
    bytes move then, nothing to watch or decide), else ``active``. ``page_rate``:
    bytes/s of guest pages (:class:`PageRate`), QEMU's ``pages-per-second`` once
    divided by the page size; no expected downtime (libvirt has none).
    ``throttle_pct``: the throttle livemig set (the patched QEMU's direct one), else
    libvirt's auto-converge figure."""
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
                   "page-size": page, "mbps": bps * 8 / 1e6,
                   "pages-per-second": page_rate / page}
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
