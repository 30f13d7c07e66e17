"""``livemig soak --summarize LEDGER...``: one table row per combination.

Columns: hops, ok (completed, every verdict ok or explained by the injected fault, no
guest lost), mismatches (unexplained), guests lost, faults injected/caught, and the
median guest-visible pause (the gap in the agent's heartbeats: what the guest felt of
the switchover) and total migration time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig.errors import UsageError
from livemig.soak import ledger


@dataclass
class Row:
    hops: int = 0
    ok: int = 0
    mismatches: int = 0
    lost: int = 0
    injected: int = 0
    caught: int = 0
    pauses: list[float] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)

    def add(self, e: dict[str, Any]) -> None:
        self.hops += 1
        self.ok += not ledger.bad(e) and e.get("outcome") == "completed"
        self.mismatches += int(e.get("mismatches") or 0)
        self.lost += bool(e.get("guest_lost"))
        f = e.get("fault")
        if f is not None:
            self.injected += 1
            self.caught += bool(f.get("caught"))
        t = e.get("timings") or {}
        if e.get("outcome") == "completed":
            if t.get("guest_pause_ms") is not None:
                self.pauses.append(float(t["guest_pause_ms"]))
            if t.get("total_s") is not None:
                self.totals.append(float(t["total_s"]))


@dataclass
class Summary:
    rows: dict[str, Row]
    total: Row
    ledgers: list[Path]
    problems: list[str]  # "hop N (combination): what", for every bad hop

    @property
    def clean(self) -> bool:
        return not self.problems


def summarize(paths: list[Path], since: int = 1) -> Summary:
    """``since``: only the hops numbered from it on (in every ledger)."""
    rows: dict[str, Row] = {}
    total = Row()
    problems = []
    for p in paths:
        if not p.is_file():
            raise UsageError(f"no ledger at {p}")
        for e in ledger.read(p):
            if int(e.get("hop", 0)) < since:
                continue
            name = str(e.get("combination"))
            rows.setdefault(name, Row()).add(e)
            total.add(e)
            what = ledger.bad(e)
            if what:
                problems.append(f"{p.name} hop {e['hop']} ({name}): {'; '.join(what)}")
    return Summary(dict(sorted(rows.items())), total, paths, problems)


def _median(xs: list[float], fmt: str) -> str:
    return format(statistics.median(xs), fmt) if xs else "-"


def table(s: Summary) -> str:
    """A Markdown table, one row per combination and a total."""
    head = ("| combination | hops | ok | mismatches | guests lost | faults injected/caught "
            "| median guest pause ms | median total s |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in [*s.rows.items(), ("**all**", s.total)]:
        lines.append(f"| {name} | {r.hops} | {r.ok} | {r.mismatches} | {r.lost} | "
                     f"{r.injected}/{r.caught} | {_median(r.pauses, '.0f')} | "
                     f"{_median(r.totals, '.1f')} |")
    return "\n".join(lines)


def report(s: Summary) -> str:
    out = [table(s), "",
           f"{s.total.hops} hops over {len(s.rows)} combinations, {s.total.ok} ok, "
           f"{s.total.mismatches} mismatches, {s.total.lost} guests lost, faults "
           f"{s.total.caught}/{s.total.injected} caught"]
    out += [f"PROBLEM {p}" for p in s.problems]
    return "\n".join(out)
