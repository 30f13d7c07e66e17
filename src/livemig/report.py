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
    if total is not None and m.t_ram is not None and m.t_migrate is not None:
        total += (m.t_ram - m.t_migrate) * 1000.0  # the disk copy ran first
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
    guest_errors = [e for a in (m.src_agent, m.dst_agent) if a for e in a.verify_errors
                    if e.get("t", m.t0) >= m.t0]  # a handed-over agent has older ones
    disk: dict[str, Any] = {"disk_transferred_bytes": 0, "disk_dirty_amplification": None}
    if m.disk is not None:
        disk = m.disk.stats.as_report()
    disk_check: dict[str, Any] = {"result": "skipped", "why": f"storage {o.storage}"}
    if m.disk_check is not None:
        disk_check = m.disk_check.as_dict()
    net = dict(m.network)
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
        **disk,
        "network_pause_ms": net.get("network_pause_ms"),
        "probes_lost": net.get("probes_lost"),
        "network": net,
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
            "disk": disk_check["result"],
            "disk_detail": disk_check,
            "guest": "mismatch" if guest_errors else (
                "ok" if o.workload.verify else "skipped"),
            "guest_errors": guest_errors[:16],
        },
        "source_after": m.source_after,
        "pinning": m.pinning or None,
        "encoding": m.encoding,
        "qemu_final_stats": stats,
        "timeline": m.timeline,
        "events": m.events,
        "settings": {
            "profile": o.profile,
            **m.resolved.as_dict(),
            "memory": o.memory, "vcpus": o.vcpus, "bandwidth": o.bandwidth,
            "max_time": o.max_time, "qemu": str(o.qemu), "accel": o.accel,
            "testbed": o.testbed, "link_bits": o.link if o.testbed else None,
            "storage": o.storage,
            "accel_reason": o.accel_reason, "verify": o.verify,
            "faults": m.injected or [
                {"kind": f.kind, "address": f"{f.address:#x}"} for f in o.faults],
            "total_time_includes_disk_copy": m.disk is not None,
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
        + f", disk {cons['disk']}"
        + (f" at {', '.join(cons['disk_detail']['first_mismatches'])}"
           if cons["disk"] == "mismatch" else "")
        + f", guest checker {cons['guest']}",
    ]
    if r.get("network", {}).get("probes_sent"):
        n = r["network"]
        who = n.get("after_switchover", {}).get("answered_by")
        lines.insert(4, f"network pause    {_f(r['network_pause_ms'], ' ms')}, "
                        f"{r['probes_lost']} of {n['probes_sent']} probes lost"
                        + (f", answered by the {who} afterwards" if who else ""))
    if r.get("disk_transferred_bytes"):
        lines.insert(6, f"disk sent        {fmt_bytes(r['disk_transferred_bytes'])}, "
                        f"dirty amplification {_f(r['disk_dirty_amplification'], 'x')}")
    if r.get("source_after"):
        sa = r["source_after"]
        lines.append(f"source after     {sa.get('status')}, workload "
                     f"{fmt_rate(sa.get('workload_rate'))}")
    return "\n".join(lines)


def _f(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
