"""Each ``query-migrate`` reply parsed once into a typed, frozen Observation.

The same observation feeds the policies' :class:`Snapshot`, the record's timeline
and the progress line, so all three see the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from livemig.policy.base import Snapshot

TERMINAL = frozenset({"completed", "failed", "cancelled"})
# not QEMU's: the monitor's status while the RAM waits for the caller's disk copy
DISK_FIRST = "disk-first"
# not QEMU's: a source that copies its disks before it sends RAM on its own (libvirt's
# NBD mirror, :mod:`livemig.virt.stats`); the policies act then too (IO QoS)
DISK_COPY = "disk"
# the states in which the monitor ticks the policies
POLICY_STATES = frozenset({"active", DISK_COPY})


@dataclass(frozen=True)
class Observation:
    t: float  # seconds since ``migrate`` was issued
    status: str
    rounds: int  # dirty-bitmap syncs (dirty-sync-count)
    transferred: int | None
    remaining: int | None
    total: int | None
    dirty_rate: float  # bytes/s
    bandwidth: float | None  # bytes/s
    page_rate: float  # bytes/s of guest pages moved (pages-per-second x page size)
    throttle_pct: int
    expected_downtime_ms: int | None
    deferred_pages: int | None
    error: str | None
    # the vCPUs' share of the CPU time they asked for over the last poll
    # (:mod:`livemig.engine.vcpushare`); None: not read
    vcpu_share: float | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def parse(cls, t: float, info: dict[str, Any]) -> Observation:
        ram = info.get("ram") or {}
        page = ram.get("page-size") or 4096
        mbps = ram.get("mbps")
        return cls(
            t=round(t, 3),
            status=str(info.get("status", "none")),
            rounds=int(ram.get("dirty-sync-count") or 0),
            transferred=ram.get("transferred"),
            remaining=ram.get("remaining"),
            total=ram.get("total"),
            dirty_rate=float(ram.get("dirty-pages-rate") or 0) * page,
            bandwidth=float(mbps) * 1e6 / 8 if mbps else None,
            page_rate=float(ram.get("pages-per-second") or 0) * page,
            throttle_pct=int(info.get("cpu-throttle-percentage") or 0),
            expected_downtime_ms=info.get("expected-downtime"),
            deferred_pages=ram.get("deferred-pages"),
            error=info.get("error-desc"),
        )

    def snapshot(self, disk: dict[str, Any] | None = None) -> Snapshot:
        d = disk or {}
        return Snapshot(
            t=self.t, rounds=self.rounds, remaining=int(self.remaining or 0),
            dirty_rate=self.dirty_rate, bandwidth=float(self.bandwidth or 0.0),
            throttle_pct=self.throttle_pct, ram_total=int(self.total or 0),
            disk_remaining=d.get("remaining"), disk_total=d.get("total"),
            disk_ready=bool(d.get("ready")), disk_dirty_rate=d.get("dirty_rate"),
            disk_write_rate=d.get("write_rate"), page_rate=self.page_rate,
            vcpu_share=self.vcpu_share or 0.0,
        )

    def sample(self) -> dict[str, Any]:
        """The record's timeline entry (the caller may add its own keys)."""
        s: dict[str, Any] = {
            "t": self.t, "status": self.status, "rounds": self.rounds,
            "transferred": self.transferred, "remaining": self.remaining,
            "dirty_rate": self.dirty_rate, "bandwidth": self.bandwidth,
            "throttle_pct": self.throttle_pct,
            "expected_downtime_ms": self.expected_downtime_ms,
        }
        if self.deferred_pages is not None:
            s["deferred_pages"] = self.deferred_pages
        if self.vcpu_share is not None:
            s["vcpu_share"] = round(self.vcpu_share, 3)
        if self.bandwidth and self.remaining is not None:
            s["eta_s"] = self.remaining / self.bandwidth
        return s
