"""The evacuation's report (``DIR/evacuation.json``: the plan, each VM's tries and
its migration reports, the totals) and its chart (``DIR/evacuation.png``: a bar per
VM on a time axis, planned under actual, and the count of VMs left on the host)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from livemig.evacuate import schedule
from livemig.evacuate.schedule import Plan

log = logging.getLogger(__name__)
REPORT = "evacuation.json"
CHART = "evacuation.png"


def vm_record(v: Any) -> dict[str, Any]:
    last = v.reports[-1] if v.reports else {}
    f = v.facts
    return {
        "name": v.name, "destination": v.destination, "outcome": v.status,
        "left_source": bool(getattr(v, "left_source", False)),
        "attempts": v.attempts, "reason": v.reason or None,
        "start_s": None if v.started is None else round(v.started, 3),
        "end_s": None if v.ended is None else round(v.ended, 3),
        # the completed try's first and last byte (None: not seen, or not completed)
        "stream_s": (None if getattr(v, "stream", None) is None
                     else [round(x, 3) for x in v.stream]),
        "measured": {"ram": f.ram, "nonzero": round(f.nonzero), "dirty_rate": round(f.dirty_rate),
                     "ratio": round(f.ratio, 3), "resend_ratio": round(f.resend_ratio, 3)},
        "downtime_ms": last.get("downtime_ms"),
        "ram_transferred_bytes": sum(int(r.get("ram_transferred_bytes") or 0)
                                     for r in v.reports),
        "consistency_ram": (last.get("consistency") or {}).get("ram"),
        # libvirt runs have no guest agent: guest work lost is not known there
        "guest_work_lost_s": (last.get("workload") or {}).get("work_lost_s"),
        "tries": v.tries,
    }


def build(evac: Any, plan: Plan, measured: dict[str, Any], nowhere: list[str],
          wall_s: float) -> dict[str, Any]:
    vms = [vm_record(v) for v in evac.vms]
    done = [r for r in vms if r["outcome"] == "done"]
    lost = [r["guest_work_lost_s"] for r in vms if r["guest_work_lost_s"] is not None]
    pauses = [r["downtime_ms"] for r in done if r["downtime_ms"] is not None]
    emptied = len(done) == len(vms) and not nowhere
    seen = list(getattr(evac, "overheads", None) or [])  # what the drain measured
    own = evac.overhead() if seen else None
    return {
        "outcome": "emptied" if emptied else ("cancelled" if evac.cancelled else "incomplete"),
        "reason": evac.cancelled or None,
        "time_to_empty_s": round(max(r["end_s"] for r in done), 3) if emptied and done
        else None,
        "wall_s": round(wall_s, 3),
        "started_at": round(getattr(evac, "started_at", 0.0), 3) or None,
        "expected_s": round(plan.total_s, 3),
        # what a migration cost beyond its bytes: the plan's model and this drain's
        "overhead_s": {"modelled": {"pre": schedule.MODELLED.pre,
                                    "post": schedule.MODELLED.post},
                       "measured": ({"pre": round(own.pre, 3), "post": round(own.post, 3),
                                     "migrations": len(seen)}
                                    if own is not None else None)},
        "bytes": sum(r["ram_transferred_bytes"] for r in vms),
        "longest_pause_ms": max(pauses, default=None),
        "guest_work_lost_s": {"sum": round(sum(lost), 3), "worst": max(lost)} if lost
        else None,
        "verified": sum(1 for r in done if r["consistency_ram"] == "ok"),
        "migrated": len(done),
        "failures": [r["name"] for r in vms if r["outcome"] == "failed"],
        "left_on_source": [r["name"] for r in vms
                           if r["outcome"] != "done" and not r["left_source"]] + nowhere,
        "no_room": nowhere,
        "links": evac.o.links,
        "max_parallel": evac.o.max_parallel,
        "plan": [{"name": p.name, "start_s": round(p.start, 3), "end_s": round(p.end, 3),
                  "bandwidth": [round(b) for b in p.bandwidths]} for p in plan.vms],
        "measurement": measured,
        "vms": vms,
        "events": evac.events,
    }


def write(rep: dict[str, Any], out: Path) -> Path:
    path = out / REPORT
    path.write_text(json.dumps(rep, indent=2) + "\n")
    return path


def chart(rep: dict[str, Any], out: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no chart")
        return None
    vms = rep["vms"]
    planned = {p["name"]: p for p in rep["plan"]}
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 2 + 0.5 * len(vms)), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    colors = {"done": "C2", "failed": "C3", "aborted": "C1", "skipped": "C7"}
    for i, r in enumerate(vms):
        p = planned.get(r["name"])
        if p:
            ax.barh(i + 0.2, p["end_s"] - p["start_s"], left=p["start_s"], height=0.3,
                    color="lightgrey", label="planned" if i == 0 else None)
        for k, tr in enumerate(r["tries"]):
            end = tr.get("end", r["end_s"] or tr["t"])
            ax.barh(i - 0.15, end - tr["t"], left=tr["t"], height=0.4,
                    color=colors.get(r["outcome"] if k == len(r["tries"]) - 1 else "failed",
                                     "C0"))
    ax.set_yticks(range(len(vms)), [f"{r['name']} ({r['outcome']})" for r in vms])
    ax.invert_yaxis()
    ax.set_title(f"evacuation: {rep['outcome']}"
                 + (f", empty after {rep['time_to_empty_s']:.1f} s"
                    if rep["time_to_empty_s"] else "")
                 + f" (planned {rep['expected_s']:.1f} s; grey: plan)")
    ends = sorted(r["end_s"] for r in vms if r["outcome"] == "done" and r["end_s"])
    xs, ys = [0.0], [len(vms)]
    for k, e in enumerate(ends):
        xs += [e, e]
        ys += [len(vms) - k, len(vms) - k - 1]
    xs.append(max(rep["wall_s"], xs[-1]))
    ys.append(ys[-1])
    ax2.plot(xs, ys, color="k")
    ax2.set_ylabel("VMs left")
    ax2.set_xlabel("seconds since the evacuation started")
    if any(planned):
        ax.legend(loc="lower right")
    fig.tight_layout()
    path = out / CHART
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
