"""Where an evacuation's seconds went, per VM, from its reports (not a test):
``python -m livemig.evacuate.phases DIR [DIR...]``.

Each VM's last try, on the evacuation's clock, in the phases a migration goes through:

- ``up``: the child ``livemig migrate --domain`` from its spawn to its start (Python,
  imports);
- ``prepare``: from its start to libvirt's migration call (connections, probes, the
  page sample, the source's settings); ``sample`` is the sample's own wall time (0
  when the evacuation's was reused);
- ``qemu``: QEMU's migration, from the call to the source QEMU's completion
  (``time_elapsed``);
- ``finish``: libvirt after QEMU completed (the destination's resume, confirm,
  ``virDomainMigrateToURI3`` returning);
- ``after``: the child's checks, its report and exit, and the evacuation's poll.

DIR holds ``evacuation.json`` and the children's reports (the paths it names).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("up", "prepare", "qemu", "finish", "after")


@dataclass(frozen=True)
class VmPhases:
    name: str
    start: float  # spawned, seconds into the evacuation
    end: float  # the evacuation saw it done
    up: float
    prepare: float
    sample: float
    qemu: float
    finish: float
    after: float
    wire: int  # RAM bytes sent
    cap: float  # bytes/s at the start


def _t0(ev: dict[str, Any], mtimes: dict[str, float]) -> float:
    if ev.get("started_at"):
        return float(ev["started_at"])
    # older reports: a child's report was written just before the evacuation saw it
    # exit, so the drain began no earlier than any report's time less its end
    return max(mtimes[v["name"]] - float(v["end_s"]) for v in ev["vms"]
               if v["name"] in mtimes)


def of_run(d: Path) -> list[VmPhases]:
    ev = json.loads((d / "evacuation.json").read_text())
    reports: dict[str, dict[str, Any]] = {}
    mtimes: dict[str, float] = {}
    for v in ev["vms"]:
        if not v["tries"]:
            continue
        p = Path(v["tries"][-1]["report"])
        if not p.exists():
            p = d / p.name
        if p.exists():
            reports[v["name"]] = json.loads(p.read_text())
            mtimes[v["name"]] = p.stat().st_mtime
    t0 = _t0(ev, mtimes)
    out = []
    for v in ev["vms"]:
        c = reports.get(v["name"])
        if c is None or v["outcome"] != "done":
            continue
        tr = v["tries"][-1]
        born = datetime.datetime.fromisoformat(c["started_at"]).timestamp() - t0
        called = next(e["t"] for e in c["events"] if e["event"] == "migration started")
        qemu = float(c["qemu_final_stats"]["time_elapsed"]) / 1000
        total = float(c["total_time_s"])
        sampler = (c.get("encoding") or {}).get("sampler") or {}
        given = "given" in sampler
        out.append(VmPhases(
            v["name"], tr["t"], v["end_s"], born - tr["t"], called,
            0.0 if given else float(sampler.get("wall_s") or 0.0), qemu, total - qemu,
            v["end_s"] - (born + called + total), int(c.get("ram_transferred_bytes") or 0),
            float(tr["bandwidth"])))
    return out


def table(runs: dict[str, list[VmPhases]]) -> str:
    lines = ["| run | VM | start | up | prepare (sample) | QEMU | libvirt finish | after | "
             "end | MB sent |", "| --- " * 10 + "|"]
    for name, vms in runs.items():
        last = max((v.end for v in vms), default=0.0)
        for v in vms:
            mark = " **last**" if v.end == last else ""
            lines.append(f"| {name} | {v.name}{mark} | {v.start:.1f} | {v.up:.2f} | "
                         f"{v.prepare:.2f} ({v.sample:.2f}) | {v.qemu:.2f} | {v.finish:.2f} | "
                         f"{v.after:.2f} | {v.end:.2f} | {v.wire / 1e6:.1f} |")
    return "\n".join(lines)


def medians(runs: dict[str, list[VmPhases]]) -> dict[str, float]:
    """Each phase's median over every VM of these runs, and the sample's."""
    vms = [v for r in runs.values() for v in r]
    if not vms:
        return {}
    return {k: round(statistics.median(getattr(v, k) for v in vms), 2)
            for k in (*PHASES, "sample")}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m livemig.evacuate.phases DIR [DIR...]", file=sys.stderr)
        return 2
    runs: dict[str, list[VmPhases]] = {}
    for a in argv:
        d = Path(a)
        if not (d / "evacuation.json").exists():
            print(f"livemig: {d}/evacuation.json: no such file", file=sys.stderr)
            return 2
        runs[str(d)] = of_run(d)
    print(table(runs))
    print()
    print("median per VM: " + ", ".join(f"{k} {v:.2f} s" for k, v in medians(runs).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
