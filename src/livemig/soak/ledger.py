"""The soak's ledger: one JSON line per hop, appended as each hop ends.

A line holds the time, the combination (name and features), the hosts, the outcome,
each verdict (ram, disk, checker), the timings, the injected fault and whether the host
comparison and the guest checker caught it, unexplained mismatches and whether the
guest was lost. Lines are flushed and fsynced one by one, so a soak stopped at any
moment (Ctrl-C, a crash, the host going down) leaves every finished hop in the ledger;
``--resume`` reads it and continues after the last hop. A last line cut short by a
crash is dropped on resume (that hop is run again); a bad line elsewhere is an error.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.errors import UsageError
from livemig.pingpong import Hop
from livemig.soak.combos import SoakCombo

VERSION = 1


def entry(hop: Hop, combo: SoakCombo, run_id: str, fault_kind: str | None,
          load: str | None = None) -> dict[str, Any]:
    """The ledger line of one hop; ``load``: the workload the guest ran (the
    combination's, except when the hop booted the guest with the boot load)."""
    d = hop.as_dict()
    fault = None
    if fault_kind is not None:
        fault = {"kind": fault_kind, "injected": len(hop.injected),
                 "where": [f.get("block") for f in hop.injected],
                 "caught_by_host": hop.detected_by_host,
                 "caught_by_guest": hop.detected_by_guest,
                 "caught": caught(hop)}
    return {
        "v": VERSION, "hop": hop.index,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": run_id, "combination": combo.name, "features": combo.features(),
        "from": hop.src, "to": hop.dst, "outcome": d["outcome"], "reason": d["reason"],
        "verdicts": {"ram": d["ram"], "disk": d["disk"], "checker": d["guest"]},
        "timings": {"total_s": d["total_time_s"],
                    "downtime_ms": hop.report.get("downtime_ms"),  # QEMU's
                    "guest_pause_ms": d["guest_pause_ms"],  # the agent's heartbeat gap
                    "network_pause_ms": d["network_pause_ms"],
                    # the destination held paused for the disk comparison (left out of
                    # guest_pause_ms, as far as the run measured it)
                    "verify_hold_ms": hop.report.get("verify_hold_ms"),
                    "hop_wall_s": round(hop.wall_s, 3)},
        "fault": fault, "mismatches": hop.unexplained, "guest_lost": hop.guest_lost,
        "load": load if load is not None else combo.workload,
    }


def caught(hop: Hop) -> bool:
    """Every fault injected in the hop was named by the host comparison and the checker."""
    n = len(hop.injected)
    return n > 0 and hop.detected_by_host == n and hop.detected_by_guest == n


def bad(e: dict[str, Any]) -> list[str]:
    """What is wrong with a hop of the ledger (empty: a good hop)."""
    out = []
    if e.get("guest_lost"):
        out.append("guest lost")
    if e.get("mismatches"):
        out.append(f"{e['mismatches']} unexplained mismatches")
    f = e.get("fault")
    if f is not None and not f.get("caught"):
        out.append(f"injected {f.get('kind')} not caught (host named "
                   f"{f.get('caught_by_host')}, checker {f.get('caught_by_guest')} of "
                   f"{f.get('injected')})")
    if e.get("outcome") != "completed" and not out:
        out.append(f"{e.get('outcome')}: {e.get('reason')}")
    return out


@dataclass
class State:
    """Where a ledger left off."""

    last_hop: int = 0
    hops_since_fault: int = 0
    run: str | None = None


def read(path: Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The ledger's lines. ``repair``: cut a last line left half-written by a crash."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UsageError(f"cannot read ledger {path}: {e.strerror}") from None
    lines = raw.split(b"\n")
    out: list[dict[str, Any]] = []
    good = 0  # bytes of whole, valid lines
    for i, line in enumerate(lines):
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("hop"), int):
                raise ValueError("not a hop")
        except ValueError:
            last = i == len(lines) - 1  # no newline after it: cut short mid-write
            if last and repair:
                with open(path, "r+b") as f:
                    f.truncate(good)
                break
            if last:
                break
            raise UsageError(f"ledger {path}: line {i + 1} is not a hop record") from None
        out.append(rec)
        good += len(line) + 1
    return out


def state(entries: list[dict[str, Any]]) -> State:
    s = State()
    for e in entries:
        s.last_hop = max(s.last_hop, int(e["hop"]))
        s.run = e.get("run", s.run)
        s.hops_since_fault = 0 if e.get("fault") else s.hops_since_fault + 1
    return s


class Ledger:
    """Appends hop lines to the ledger file, one fsynced line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, e: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(e, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
