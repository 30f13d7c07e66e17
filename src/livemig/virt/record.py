"""The report of a libvirt run: the same top-level keys as a lab run (see README
"The report"), with what libvirt cannot know set to None and said why."""

from __future__ import annotations

import datetime
from typing import Any

from livemig import __version__
from livemig.units import fmt_bytes
from livemig.virt.run import DomainRun


def build(r: DomainRun) -> dict[str, Any]:
    o = r.opts
    cs = r.completed_stats
    completed = r.result.outcome == "completed"
    # wall clock of virDomainMigrateToURI3: libvirt's begin/prepare (the destination
    # QEMU starting), the disk copy, RAM, finish; libvirt's own figure (RAM from the
    # start of QEMU's migration) is qemu_final_stats.time_elapsed
    total_ms = None
    if r.t_migrate is not None:
        total_ms = ((r.t_end or r.t_migrate) - r.t_migrate) * 1000.0
    last = r.timeline[-1] if r.timeline else {}
    plan = r.plan.as_dict() if r.plan else None
    return {
        "livemig_version": __version__,
        "engine": "libvirt",
        "encoding": r.encoding,
        "started_at": datetime.datetime.fromtimestamp(r.t0, datetime.UTC).isoformat(),
        "outcome": r.result.outcome,
        "reason": r.result.reason,
        "total_time_s": None if total_ms is None else round(float(total_ms) / 1000.0, 3),
        "setup_time_ms": cs.get("setup_time"),
        "downtime_ms": cs.get("downtime") if completed else None,
        "guest_pause_ms": None,  # no livemig agent or probe in a libvirt domain
        "ram_transferred_bytes": cs.get("memory_processed", last.get("transferred")),
        "ram_total_bytes": cs.get("memory_total"),
        "disk_transferred_bytes": max(int(cs.get("disk_processed") or 0),
                                      int(last.get("disk_transferred") or 0)),
        "rounds": cs.get("memory_iteration", last.get("rounds")),
        "cpu_seconds": {"source": r.cpu.get("source"),
                        "destination": r.cpu.get("destination"),
                        "source_migration_threads": None},
        "workload": {"note": "no livemig agent in the domain: workload figures absent"},
        "consistency": {
            "ram": r.ram_check.get("result", "skipped"), "ram_detail": r.ram_check,
            "disk": r.disk_check.get("result", "skipped"),
            "disk_detail": r.disk_check or {"result": "skipped",
                                            "why": f"storage {o.request.storage}"},
            "guest": "skipped",
        },
        "source_after": r.source_after,
        "destination": r.destination,
        "libvirt": r.libvirt,
        "qemu_final_stats": cs,
        "timeline": r.timeline,
        "events": r.events,
        "settings": {
            "profile": o.profile, "wanted": dict(o.wanted), "libvirt_plan": plan,
            "domain": o.domain, "connect": o.src_uri, "to": o.dst_uri,
            "storage": o.request.storage, "bandwidth": o.request.bandwidth,
            "max_time": o.max_time, "verify": o.request.verify,
            "unsafe": o.request.unsafe,
        },
    }


def summary(rep: dict[str, Any]) -> str:
    cons = rep["consistency"]
    cpu = rep["cpu_seconds"]
    lines = [
        f"outcome          {rep['outcome']}"
        + (f" ({rep['reason']})" if rep.get("reason") else ""),
        f"total time       {_f(rep['total_time_s'], 's')}",
        f"downtime (QEMU)  {_f(rep['downtime_ms'], ' ms')}",
        f"RAM sent         {fmt_bytes(rep['ram_transferred_bytes'])}"
        + (f" in {rep['rounds']} rounds" if rep["rounds"] is not None else ""),
        f"CPU seconds      source {_f(cpu['source'], '')}, destination "
        f"{_f(cpu['destination'], '')}",
        f"consistency      RAM {cons['ram']}{_ram_note(cons['ram_detail'])}, disk "
        f"{cons['disk']}" + _disk_note(cons["disk_detail"]),
    ]
    if rep.get("disk_transferred_bytes"):
        lines.insert(4, f"disk sent        {fmt_bytes(rep['disk_transferred_bytes'])}")
    if rep.get("source_after"):
        lines.append(f"source after     {rep['source_after'].get('status')}")
    return "\n".join(lines)


def _disk_note(d: dict[str, Any]) -> str:
    """Where each mismatching disk differs, or the cost of a streamed comparison."""
    notes = []
    for t, x in d.get("disks", {}).items():
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


def _ram_note(d: dict[str, Any]) -> str:
    if d.get("result") == "ok" and "source_s" in d:
        return (f" ({d['method']}: {fmt_bytes(d['bytes'])}, source "
                f"{d['source_s']:.3f} s, destination {d['destination_s']:.3f} s)")
    if d.get("result") == "mismatch":
        return f" ({d['detail']})"
    return ""


def _f(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if abs(v) < 100 else f"{v:.0f}{unit}"
