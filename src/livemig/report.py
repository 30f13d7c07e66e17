"""The JSON report of one migration and its human summary.

The report only reads: the engine's immutable :class:`MigrationRecord`, plus, for a
lab run, the lab's :class:`LabFacts` (what only the lab can measure: the guest
agent's workload and heartbeats, the client's probes, the disk copy). An attach run
has the same keys, with the lab-only figures absent (``None``/empty). A libvirt run
(``--domain``) adds its :class:`LibvirtFacts` (what only libvirt knows: its flags and
parameters, its job statistics, the daemons, the copied disks' comparison).

Stable keys (other tools rely on them; add more freely, never rename):
outcome, total_time_s, downtime_ms, guest_pause_ms, ram_transferred_bytes,
disk_transferred_bytes, rounds, cpu_seconds, workload, consistency, timeline, settings.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig import __version__
from livemig.engine.record import MigrationRecord
from livemig.units import fmt_bytes, fmt_rate

CONTRACT_KEYS = (
    "outcome", "total_time_s", "downtime_ms", "guest_pause_ms", "ram_transferred_bytes",
    "disk_transferred_bytes", "rounds", "cpu_seconds", "workload", "consistency",
    "timeline", "settings",
)


@dataclass(frozen=True)
class LabFacts:
    """What a lab run measured around the engine's migration."""

    workload: dict[str, Any]
    pause: dict[str, float | None]  # guest_pause_ms, guest_pause_raw_ms, verify_hold_ms
    network: dict[str, Any]
    disk: dict[str, Any]  # disk_transferred_bytes, disk_dirty_amplification, ...
    disk_check: dict[str, Any]
    guest: str  # ok | mismatch | skipped (the guest's own checker)
    guest_errors: list[dict[str, Any]]
    migration_thread_cpu: float | None
    encoding: dict[str, Any] | None
    settings: dict[str, Any]  # memory, vcpus, qemu, testbed, storage, faults, ...
    qemu_trace: dict[str, Any] | None = None  # bitmap syncs, downtime steps (--qemu-trace)


@dataclass(frozen=True)
class AttachFacts:
    """An attach run: the sockets it was given; no agent, no probes."""

    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LibvirtFacts:
    """A libvirt run (``--domain``): what only libvirt knows. The RAM verdict is here,
    not in the record's :class:`RamVerdict`: under libvirt RAM is verified inside the
    stream by QEMU (``x-ram-digest-check``), whose figures (blocks, per-side seconds,
    QEMU's message on a mismatch) have no counterpart in the engine's comparison."""

    libvirt: dict[str, Any]  # library/daemon versions, hosts, emulator
    job_stats: dict[str, Any]  # libvirt's completed-job statistics (the destination's)
    ram_check: dict[str, Any]  # consistency.ram_detail
    disk_check: dict[str, Any]  # consistency.disk_detail (--storage copy)
    disk_transferred_bytes: int
    destination: dict[str, Any]  # running, persistent, gone_from_source
    settings: dict[str, Any]  # domain, connect, to, storage, libvirt_plan, wanted, ...
    absent: dict[str, str] = field(default_factory=dict)  # report key -> why it is None


Facts = LabFacts | AttachFacts | LibvirtFacts


def build_report(rec: MigrationRecord, lab: Facts | None = None) -> dict[str, Any]:
    stats = rec.final_stats
    ram = stats.get("ram", {})
    total = rec.total_ms
    plan = rec.plan
    is_lab = isinstance(lab, LabFacts)
    lv = lab if isinstance(lab, LibvirtFacts) else None
    ram_check = dict(lv.ram_check) if lv is not None else rec.ram_dict()
    pause: dict[str, float | None] = {
        "guest_pause_ms": None, "guest_pause_raw_ms": None,
        "verify_hold_ms": rec.verify_hold_ms}
    if isinstance(lab, LabFacts):
        pause = dict(lab.pause)
    net = dict(lab.network) if isinstance(lab, LabFacts) else {}
    disk: dict[str, Any] = {"disk_transferred_bytes": 0, "disk_dirty_amplification": None}
    disk_check: dict[str, Any] = {"result": "skipped", "why": "disk not copied by livemig"}
    if isinstance(lab, LabFacts):
        disk, disk_check = dict(lab.disk), dict(lab.disk_check)
    elif lv is not None:
        disk = {"disk_transferred_bytes": lv.disk_transferred_bytes,
                "disk_dirty_amplification": None}  # libvirt's NBD mirror does not say
        disk_check = dict(lv.disk_check)
    workload: dict[str, Any] = (dict(lab.workload) if isinstance(lab, LabFacts) else
                                {"spec": None, "why": "no livemig agent in the guest"})
    if lv is not None:
        workload["note"] = "no livemig agent in the domain: workload figures absent"
    settings: dict[str, Any] = {
        "profile": plan.profile if plan else None,
        **(rec.settings or {"capabilities": {}, "parameters": {}, "livemig": {}}),
        "bandwidth": plan.bandwidth if plan else None,
        "max_time": plan.max_time if plan else None,
        "accel": plan.accel if plan else None,
        "verify": rec.verify, "uri": rec.uri or None,
    }
    settings.update(lab.settings if lab is not None else {})
    report: dict[str, Any] = {
        "livemig_version": __version__,
        "run_id": rec.run_id,
        # a lab-booted guest migrated through the attach path (bench --via attach)
        "mode": ("libvirt" if lv is not None else
                 "attach" if not is_lab or settings.get("via") == "attach" else "lab"),
        "started_at": datetime.datetime.fromtimestamp(rec.t0, datetime.UTC).isoformat(),
        "outcome": rec.outcome,
        "reason": rec.reason,
        "total_time_s": None if total is None else round(total / 1000.0, 3),
        "setup_time_ms": stats.get("setup-time"),
        "downtime_ms": rec.downtime_ms,
        **pause,
        "ram_transferred_bytes": ram.get("transferred"),
        "ram_total_bytes": ram.get("total"),
        **disk,
        "network_pause_ms": net.get("network_pause_ms"),
        "probes_lost": net.get("probes_lost"),
        "network": net,
        "rounds": ram.get("dirty-sync-count"),
        "cpu_seconds": {
            "source": rec.cpu.get("source"),
            "destination": rec.cpu.get("destination"),
            "source_migration_threads": (lab.migration_thread_cpu
                                         if isinstance(lab, LabFacts) else None),
        },
        "workload": workload,
        "consistency": {
            "ram": ram_check["result"],
            "ram_detail": ram_check,
            "disk": disk_check["result"],
            "disk_detail": disk_check,
            "guest": lab.guest if isinstance(lab, LabFacts) else "skipped",
            "guest_errors": lab.guest_errors[:16] if isinstance(lab, LabFacts) else [],
        },
        "source_after": rec.source_after,
        "settings_restored": rec.restored,
        "pinning": rec.pinning,
        "encoding": rec.encoding or (lab.encoding if isinstance(lab, LabFacts) else None),
        "qemu_trace": lab.qemu_trace if isinstance(lab, LabFacts) else None,
        "qemu_final_stats": stats,
        "timeline": list(rec.timeline),
        "events": list(rec.events),
        "settings": settings,
    }
    if lv is not None:
        report.update({
            "engine": "libvirt",  # the key libvirt reports had before "mode"
            "libvirt": lv.libvirt,
            "destination": lv.destination,
            # libvirt's own figures (memory_processed, disk_processed, time_elapsed,
            # ...): what libvirt reports held here before the record was shared
            "qemu_final_stats": lv.job_stats,
            "absent": dict(lv.absent),
        })
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    """Write atomically, so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".report-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _workload_line(wl: dict[str, Any]) -> str:
    if wl.get("spec") is None:
        return "workload         - (no livemig agent in the guest)"
    unit = wl.get("unit")

    def rate(v: float | None) -> str:
        if unit is None:
            return fmt_rate(v)
        return "-" if v is None else f"{v:.0f} {unit}"

    line = (f"workload         normal {rate(wl.get('baseline_rate'))}"
            + (f" (±{wl['baseline_spread_pct']:.0f}%)"
               if wl.get("baseline_spread_pct") is not None else "")
            + f", min {rate(wl.get('min_rate'))}, below 10% for "
            f"{_f(wl.get('seconds_below_10pct'), 's')}, work lost "
            f"{_f(wl.get('work_lost_s'), 's')}")
    if wl.get("source") == "client":
        line += (f"\n                 client errors {wl.get('client_errors')}, disconnects "
                 f"{wl.get('client_disconnects')}, longest stall "
                 f"{_f(wl.get('longest_stall_s'), 's')}, after switchover "
                 f"{_f(wl.get('after_switchover_pct'), '%')} of normal")
        if wl.get("data_check") is not None:
            dc = wl["data_check"]
            line += (f"\n                 data check: {dc.get('keys')} keys read back, "
                     f"{dc.get('bad')} wrong, {dc.get('missing')} missing")
    return line


def summary(r: dict[str, Any]) -> str:
    wl = r["workload"]
    cons = r["consistency"]
    lines = [
        f"outcome          {r['outcome']}" + (f" ({r['reason']})" if r.get("reason") else ""),
        f"total time       {_f(r['total_time_s'], 's')}",
        f"downtime (QEMU)  {_f(r['downtime_ms'], ' ms')}",
        f"guest pause      {_f(r['guest_pause_ms'], ' ms')}"
        + (f"  (held {r['verify_hold_ms']:.0f} ms for the "
           + ("disk check, after QEMU's downtime)" if r.get("mode") == "libvirt" else
              "RAM check, subtracted)")
           if r.get("verify_hold_ms") else ""),
        f"RAM sent         {fmt_bytes(r['ram_transferred_bytes'])}"
        + (f" in {r['rounds']} rounds" if r["rounds"] is not None else ""),
        f"CPU seconds      source {_f(r['cpu_seconds']['source'], '')}, destination "
        f"{_f(r['cpu_seconds']['destination'], '')}, migration threads "
        f"{_f(r['cpu_seconds']['source_migration_threads'], '')}",
        _workload_line(wl),
        f"consistency      RAM {cons['ram']}{_ram_note(cons['ram'], cons['ram_detail'])}"
        + f", disk {cons['disk']}{_disk_note(cons['disk'], cons['disk_detail'])}"
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
        lines.append(f"source after     {sa.get('status')}"
                     + (f", workload {fmt_rate(sa.get('workload_rate'))}"
                        if "workload_rate" in sa else ""))
    return "\n".join(lines)


def _ram_note(result: str, d: dict[str, Any]) -> str:
    if result == "ok" and "source_s" in d:  # QEMU's in-stream check (libvirt runs)
        return (f" ({d['method']}: {fmt_bytes(d['bytes'])}, source "
                f"{d['source_s']:.3f} s, destination {d['destination_s']:.3f} s)")
    note = f" ({d['method']})" if d.get("method") else ""
    if d.get("coverage") is not None:  # a budget cut the digest comparison short
        note = (f" ({d['method']}: {100 * d['coverage']:.0f} % of RAM in ranges at random; "
                f"all of it would not fit the {d['budget_s']:g} s ram-check-budget)")
    if result == "mismatch":
        if d.get("first_mismatches"):
            note += f" at {', '.join(d['first_mismatches'])}"
        elif d.get("detail"):
            note += f": {d['detail']}"
    if result == "skipped" and d.get("why"):
        note += f" ({d['why']})"
    return note


def _disk_note(result: str, d: dict[str, Any]) -> str:
    """Where the disks differ: the lab's blocks, or per copied disk of a libvirt run
    (where each differs, why it was skipped, or what its comparison cost)."""
    if "disks" not in d:
        return (f" at {', '.join(d['first_mismatches'])}"
                if result == "mismatch" and d.get("first_mismatches") else "")
    notes = []
    for t, x in d["disks"].items():
        if x.get("result") == "mismatch" and "first_differing_byte" in x:
            rng = x.get("first_differing_chunk", {}).get("range")
            notes.append(f"{t}: {x['mismatched_chunks']} chunk(s) differ, first "
                         + (f"[{rng[0]}, {rng[1]}) " if rng else "")
                         + f"at byte {x['first_differing_byte']}")
        elif x.get("result") == "mismatch":
            notes.append(f"{t} at {', '.join(x.get('first_mismatches', []))}")
        elif x.get("result") == "skipped":
            notes.append(f"{t}: {x.get('why')}")
        elif x.get("result") == "ok" and "cost_s_per_gib" in x:
            notes.append(f"{t}: {fmt_bytes(x['bytes'])}, source {x['source_s']:.2f} s, "
                         f"destination {x['destination_s']:.2f} s")
    return f" ({'; '.join(notes)})" if notes else ""


def _f(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
