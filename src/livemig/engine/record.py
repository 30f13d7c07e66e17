"""The immutable record of one migration: what report, bench and verify read.

Built once by :meth:`livemig.engine.run.Engine.run` when the migration ends, from
timestamps the engine took and QEMU's final statistics. The pause breakdown:

- ``downtime_ms``: QEMU's own figure (completed migrations only);
- ``verify_hold_ms``: how long the destination was held paused for the RAM
  comparison (a real migration does not have it; callers subtract it from what
  they measure from outside: guest heartbeat gaps, network gaps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from livemig.engine.plan import Plan
from livemig.engine.verify import RamVerdict


@dataclass(frozen=True)
class MigrationRecord:
    run_id: str
    uri: str
    t0: float  # the run's start (wall clock)
    t_migrate: float | None  # ``migrate`` issued
    t_ram: float | None  # RAM migration started (after a disk copy, if any)
    t_end: float  # the engine finished
    t_dst_done: float | None  # the destination finished loading (QEMU's event time)
    t_cont: float | None  # the destination was resumed
    outcome: str  # completed | aborted | failed
    reason: str | None
    final_stats: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # resolved, by kind
    timeline: tuple[dict[str, Any], ...] = ()
    events: tuple[dict[str, Any], ...] = ()
    ram: RamVerdict | None = None
    verify: bool = True
    source_after: dict[str, Any] | None = None  # status after an abort or failure
    restored: dict[str, Any] = field(default_factory=dict)  # settings put back, per end
    cpu: dict[str, float | None] = field(default_factory=dict)
    destination_status: str | None = None
    plan: Plan | None = None
    encoding: dict[str, Any] | None = None  # the stream encoding's choice (engine.adapt)
    pinning: dict[str, Any] | None = None  # the source's threads pinned (engine.pinning)

    @property
    def completed(self) -> bool:
        return self.outcome == "completed"

    @property
    def downtime_ms(self) -> float | None:
        return self.final_stats.get("downtime") if self.completed else None

    @property
    def hold(self) -> tuple[float, float] | None:
        if self.t_dst_done is not None and self.t_cont is not None:
            return (self.t_dst_done, self.t_cont)
        return None

    @property
    def verify_hold_ms(self) -> float | None:
        h = self.hold
        return None if h is None else round((h[1] - h[0]) * 1000.0, 1)

    @property
    def total_ms(self) -> float | None:
        total = self.final_stats.get("total-time")
        if total is not None and self.t_ram is not None and self.t_migrate is not None:
            total += (self.t_ram - self.t_migrate) * 1000.0  # the disk copy ran first
        if total is None and self.t_migrate is not None:
            total = (self.t_end - self.t_migrate) * 1000.0
        return total

    def ram_dict(self) -> dict[str, Any]:
        if self.ram is not None:
            return self.ram.as_dict()
        if self.completed and not self.verify:
            return {"result": "skipped", "why": "--no-verify"}
        return {"result": "skipped"}
