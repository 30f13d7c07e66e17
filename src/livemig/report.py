"""The JSON report of one migration and its human summary.

Stable keys (other tools rely on them; add more freely, never rename):
outcome, total_time_s, downtime_ms, guest_pause_ms, ram_transferred_bytes,
disk_transferred_bytes, rounds, cpu_seconds, workload, consistency, timeline, settings.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from livemig import __version__, metrics
from livemig.migration import Migration
from livemig.units import fmt_bytes, fmt_rate

CONTRACT_KEYS = (
    "outcome", "total_time_s", "downtime_ms", "guest_pause_ms", "ram_transferred_bytes",
    "disk_transferred_bytes", "rounds", "cpu_seconds", "workload", "consistency",
    "timeline", "settings",
)


def build_report(m: Migration) -> dict[str, Any]:
    o = m.opts
    stats = m.final_stats
    ram = stats.get("ram", {})
    completed = m.result.outcome == "completed"
    total = stats.get("total-time")
    if total is None and m.t_migrate is not None:
        total = ((m.t_end or m.t_migrate) - m.t_migrate) * 1000.0
    rates = m._all_rates()
    wl: dict[str, Any] = {"spec": o.workload.text}
    if m.t_ready is not None and m.t_migrate is not None:
        end = (m.t_end or m.t_migrate)
        hold = (m.t_dst_done, m.t_cont) if m.t_dst_done and m.t_cont else None
        wl.update(metrics.workload_stats(rates, m.t_ready, m.t_migrate, end, hold).as_dict())
    wl["guest_agent_errors"] = sum(len(a.errors) for a in (m.src_agent, m.dst_agent) if a)
    ram_check: dict[str, Any] = {"result": "skipped"}
    if m.ram_check is not None:
        ram_check = m.ram_check.as_dict()
    elif completed and not o.verify:
        ram_check = {"result": "skipped", "why": "--no-verify"}
    guest_errors = [e for a in (m.src_agent, m.dst_agent) if a for e in a.verify_errors]
    report: dict[str, Any] = {
        "livemig_version": __version__,
        "run_id": m.id,
        "started_at": datetime.datetime.fromtimestamp(m.t0, datetime.UTC).isoformat(),
        "outcome": m.result.outcome,
        "reason": m.result.reason,
        "total_time_s": None if total is None else round(total / 1000.0, 3),
        "setup_time_ms": stats.get("setup-time"),
        "downtime_ms": stats.get("downtime") if completed else None,
        **m.pause(),
        "ram_transferred_bytes": ram.get("transferred"),
        "ram_total_bytes": ram.get("total"),
        "disk_transferred_bytes": 0,
        "rounds": ram.get("dirty-sync-count"),
        "cpu_seconds": {
            "source": m.cpu.get("source"),
            "destination": m.cpu.get("destination"),
            "source_migration_threads": round(m.src.migration_thread_cpu(), 3) if m.src else None,
        },
        "workload": wl,
        "consistency": {
            "ram": ram_check["result"],
            "ram_detail": ram_check,
            "disk": "skipped",
            "guest": "mismatch" if guest_errors else (
                "ok" if o.workload.verify else "skipped"),
            "guest_errors": guest_errors[:16],
        },
        "source_after": m.source_after,
        "qemu_final_stats": stats,
        "timeline": m.timeline,
        "events": m.events,
        "settings": {
            "profile": o.profile,
            **m.resolved.as_dict(),
            "memory": o.memory, "vcpus": o.vcpus, "bandwidth": o.bandwidth,
            "max_time": o.max_time, "qemu": str(o.qemu), "accel": o.accel,
            "accel_reason": o.accel_reason, "verify": o.verify,
            "faults": [{"kind": f.kind, "address": f"{f.address:#x}"} for f in o.faults],
        },
    }
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write atomically, so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".report-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def summary(r: dict[str, Any]) -> str:
    wl = r["workload"]
    cons = r["consistency"]
    lines = [
        f"outcome          {r['outcome']}" + (f" ({r['reason']})" if r.get("reason") else ""),
        f"total time       {_f(r['total_time_s'], 's')}",
        f"downtime (QEMU)  {_f(r['downtime_ms'], ' ms')}",
        f"guest pause      {_f(r['guest_pause_ms'], ' ms')}"
        + (f"  (held {r['verify_hold_ms']:.0f} ms for the RAM check, subtracted)"
           if r.get("verify_hold_ms") else ""),
        f"RAM sent         {fmt_bytes(r['ram_transferred_bytes'])}"
        + (f" in {r['rounds']} rounds" if r["rounds"] is not None else ""),
        f"CPU seconds      source {_f(r['cpu_seconds']['source'], '')}, destination "
        f"{_f(r['cpu_seconds']['destination'], '')}, migration threads "
        f"{_f(r['cpu_seconds']['source_migration_threads'], '')}",
        f"workload         normal {fmt_rate(wl.get('baseline_rate'))}, min "
        f"{fmt_rate(wl.get('min_rate'))}, below 10% for {_f(wl.get('seconds_below_10pct'), 's')}",
        f"consistency      RAM {cons['ram']}"
        + (f" at {', '.join(cons['ram_detail']['first_mismatches'])}"
           if cons["ram"] == "mismatch" else "")
        + f", disk {cons['disk']}, guest checker {cons['guest']}",
    ]
    if r.get("source_after"):
        sa = r["source_after"]
        lines.append(f"source after     {sa.get('status')}, workload "
                     f"{fmt_rate(sa.get('workload_rate'))}")
    return "\n".join(lines)


def _f(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
