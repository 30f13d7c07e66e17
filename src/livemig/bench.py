"""``livemig bench``: scenarios × profiles, side by side, in one run.

A scenario file (TOML, see bench/scenarios/) fixes the guest, workload and link;
each profile runs ``repeats`` times on it, interleaved (A B C A B C ...) so that
machine noise hits every profile alike. Results: medians per profile, ratios against
the best stock ("upstream*") profile measured in the same run, a Markdown table,
the raw reports as JSON and, when matplotlib is installed, plots.
"""

from __future__ import annotations

import json
import logging
import statistics
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from livemig.errors import UsageError
from livemig.lab.run import LabRun, MigrateOptions
from livemig.progress import Progress
from livemig.report import write_report
from livemig.settings import PROFILES, merge
from livemig.spec import parse_workload
from livemig.units import parse_link_rate, parse_size

log = logging.getLogger(__name__)

# (column, report getter, lower is better)
METRICS: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
    ("total_time_s", lambda r: r["total_time_s"]),
    ("ram_sent_mib", lambda r: _div(r["ram_transferred_bytes"], 1 << 20)),
    ("downtime_ms", lambda r: r["downtime_ms"]),
    ("guest_pause_ms", lambda r: r["guest_pause_ms"]),
    ("network_pause_ms", lambda r: r.get("network_pause_ms")),
    ("disk_sent_mib", lambda r: _div(r.get("disk_transferred_bytes") or None, 1 << 20)),
    ("below_10pct_s", lambda r: r["workload"].get("seconds_below_10pct")),
    ("src_cpu_s", lambda r: r["cpu_seconds"]["source"]),
    ("mig_thread_cpu_s", lambda r: r["cpu_seconds"]["source_migration_threads"]),
]


def _div(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


def load_scenario(path: Path) -> dict[str, Any]:
    try:
        sc = tomllib.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read scenario {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"bad scenario {path}: {e}") from None
    for key in ("workload", "memory"):
        if key not in sc:
            raise UsageError(f"scenario {path}: missing '{key}'")
    sc.setdefault("name", path.stem)
    sc.setdefault("profiles", ["upstream", "livemig"])
    sc.setdefault("repeats", 1)
    if sc.get("storage", "shared") not in ("shared", "copy"):
        raise UsageError(f"scenario {path}: storage must be shared or copy")
    if str(sc.get("link", "1gbit")) != "local":
        parse_link_rate(str(sc.get("link", "1gbit")))
    parse_workload(sc["workload"])
    for p in sc["profiles"]:
        if p not in PROFILES:
            raise UsageError(f"scenario {path}: unknown profile {p!r}")
    return sc


def options_for(sc: dict[str, Any], profile: str, accel: str, reason: str,
                qemu: Path | None) -> MigrateOptions:
    sets = {k: str(v) for k, v in sc.get("set", {}).items()}
    wanted = merge(profile, sets)
    opts = MigrateOptions(
        workload=parse_workload(sc["workload"]), memory=parse_size(sc["memory"]),
        vcpus=int(sc.get("vcpus", 1)),
        bandwidth=parse_size(sc["bandwidth"]) if sc.get("bandwidth") else None,
        profile=profile, wanted=wanted, max_time=float(sc.get("max_time", 300)),
        accel=accel, accel_reason=reason,
        storage=str(sc.get("storage", "shared")), explicit=frozenset(sets),
    )
    link = str(sc.get("link", "1gbit"))
    opts.testbed = link != "local"
    opts.link = parse_link_rate(link) if opts.testbed else None
    opts.disk_fill = str(sc.get("disk_fill", "zero"))
    if sc.get("disk_size"):
        opts.disk_size = parse_size(sc["disk_size"])
    if qemu is not None:
        opts.qemu = qemu
    return opts


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for profile, reports in runs.items():
        done = [r for r in reports if r["outcome"] == "completed"]
        row: dict[str, Any] = {"runs": len(reports), "completed": len(done)}
        for name, get in METRICS:
            row[name] = median([get(r) for r in done])
        row["consistency_ok"] = all(r["consistency"]["ram"] in ("ok", "skipped") for r in done)
        out[profile] = row
    return out


def best_baseline(summary: dict[str, dict[str, Any]]) -> str | None:
    """The stock profile to beat: most completions, then shortest median time."""
    stock = [p for p in summary if p.startswith("upstream") or p == "defaults"]
    if not stock:
        return None
    return min(stock, key=lambda p: (-summary[p]["completed"],
                                     summary[p]["total_time_s"] or float("inf")))


def markdown(name: str, desc: str, summary: dict[str, dict[str, Any]]) -> str:
    base = best_baseline(summary)
    cols = [m for m, _ in METRICS]
    lines = [f"### {name}", "", desc, "",
             "| profile | completed | " + " | ".join(cols) + " | RAM check |",
             "|---" * (len(cols) + 3) + "|"]
    for profile, row in summary.items():
        cells = []
        for c in cols:
            v = row[c]
            cell = "-" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
            b = summary[base][c] if base and base != profile else None
            if v is not None and b:
                cell += f" ({v / b:.2f}×)"
            cells.append(cell)
        lines.append(f"| {profile} | {row['completed']}/{row['runs']} | " + " | ".join(cells)
                     + f" | {'ok' if row['consistency_ok'] else 'MISMATCH'} |")
    if base:
        lines += ["", f"Ratios are against `{base}`, the best stock profile in this run "
                      "(medians of completed runs)."]
    return "\n".join(lines) + "\n"


def plot(out_dir: Path, name: str, runs: dict[str, list[dict[str, Any]]]) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plots")
        return None
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for profile, reports in runs.items():
        if not reports:
            continue
        tl = reports[0]["timeline"]
        t = [s["t"] for s in tl]
        axes[0].plot(t, [(s["remaining"] or 0) / (1 << 20) for s in tl], label=profile)
        axes[1].plot(t, [s.get("guest_rate_pct") or 0 for s in tl], label=profile)
    axes[0].set_ylabel("remaining RAM (MiB)")
    axes[1].set_ylabel("guest throughput (% of normal)")
    axes[1].set_xlabel("seconds since migration start")
    axes[0].legend()
    axes[0].set_title(f"{name}: first run of each profile")
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


async def run_bench(scenarios: list[Path], out_dir: Path, accel: str, reason: str,
                    qemu: Path | None, repeats: int | None,
                    profiles: list[str] | None, quiet: bool) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    md_parts = []
    for path in scenarios:
        sc = load_scenario(path)
        profs = profiles or list(sc["profiles"])
        n = repeats or int(sc["repeats"])
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in profs}
        for i in range(n):
            for p in profs:
                print(f"== bench {sc['name']}: {p} run {i + 1}/{n}", flush=True)
                mig = LabRun(options_for(sc, p, accel, reason, qemu),
                                Progress(enabled=not quiet))
                await mig.run()
                rep = mig.report()
                write_report(rep, out_dir / f"{sc['name']}-{p}-{i + 1}.json")
                runs[p].append(rep)
                print(f"   {rep['outcome']} in {rep['total_time_s']}s", flush=True)
        summary = summarize(runs)
        md_parts.append(markdown(sc["name"], sc.get("description", ""), summary))
        (out_dir / f"{sc['name']}-summary.json").write_text(json.dumps(summary, indent=2))
        png = plot(out_dir, sc["name"], runs)
        if png:
            md_parts.append(f"![{sc['name']}]({png.name})\n")
    md = "\n".join(md_parts)
    (out_dir / "summary.md").write_text(md)
    return md
