"""``livemig bench``: scenarios × profiles, side by side, in one run.

A scenario file (TOML, see bench/scenarios/) fixes the guest, workload and link; a
matrix file holds several of them as ``[[family]]`` tables (top-level keys are the
families' defaults). Each profile runs ``repeats`` times on a family, interleaved
(A B C A B C ...) so that machine noise hits every profile alike. Stock profiles
(``upstream*``, ``defaults``) run on the *unpatched* build of the same QEMU release
(``make qemu-upstream``), so nobody has to trust that "off" equals upstream; the
table names the binary of every row. Results: medians per profile, ratios against
the best stock profile measured in the same run, the ``livemig`` profile's targets
met or missed, a Markdown table, the raw reports as JSON and, with matplotlib, a
throughput chart (every profile on one chart, switchover marked) and a ratio chart
per family.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from livemig import paths
from livemig.errors import UsageError
from livemig.lab.run import LabRun, MigrateOptions
from livemig.progress import Progress
from livemig.report import write_report
from livemig.settings import PROFILES, merge
from livemig.spec import parse_workload
from livemig.units import parse_link_rate, parse_size

log = logging.getLogger(__name__)

Getter = Callable[[dict[str, Any]], float | None]

# (column, report getter); lower is better for all of them
METRICS: list[tuple[str, Getter]] = [
    ("total_time_s", lambda r: r["total_time_s"]),
    # QEMU's ``migrate`` to its completion: a libvirt run's time without libvirt's
    # prepare (the destination QEMU's start) and its finish and confirm after the
    # switchover, the figure to set beside an attach run's total time (libvirt runs
    # only: the column is left out of tables that have none)
    ("qemu_time_s", lambda r: ((r.get("libvirt") or {}).get("phases") or {}).get(
        "migration_s")),
    ("ram_sent_mib", lambda r: _div(r["ram_transferred_bytes"], 1 << 20)),
    ("downtime_ms", lambda r: r["downtime_ms"]),
    ("guest_pause_ms", lambda r: r["guest_pause_ms"]),
    ("network_pause_ms", lambda r: r.get("network_pause_ms")),
    ("disk_sent_mib", lambda r: _div(r.get("disk_transferred_bytes") or None, 1 << 20)),
    ("below_10pct_s", lambda r: r["workload"].get("seconds_below_10pct")),
    ("below_50pct_s", lambda r: r["workload"].get("seconds_below_50pct")),
    ("work_lost_s", lambda r: r["workload"].get("work_lost_s")),
    ("src_cpu_s", lambda r: r["cpu_seconds"]["source"]),
    ("mig_thread_cpu_s", lambda r: r["cpu_seconds"]["source_migration_threads"]),
    # every page has to go once: the first pass is the floor of time and bytes that
    # no convergence policy can cut, only the encoding and the link
    ("first_pass_s", lambda r: _first_pass(r, "t")),
    ("first_pass_mib", lambda r: _div(_first_pass(r, "transferred"), 1 << 20)),
]


def _first_pass(report: dict[str, Any], key: str) -> float | None:
    """Seconds and bytes on the wire when the first pass over guest RAM ended (the
    first poll of round 2; the whole migration if it never got there)."""
    for sample in report.get("timeline", []):
        if (sample.get("rounds") or 0) >= 2 and sample.get(key) is not None:
            return float(sample[key])
    if report.get("outcome") != "completed":
        return None
    whole = report.get("total_time_s") if key == "t" else report.get("ram_transferred_bytes")
    return float(whole) if whole is not None else None

OPTIONAL = frozenset({"qemu_time_s"})  # columns shown only where some run has them

# The livemig profile's targets against the best stock profile of the same family
# (issue #12): (column, allowed ratio, absolute floor the ratio does not apply below)
TARGETS: list[tuple[str, float, float]] = [
    ("ram_sent_mib", 0.5, 0.0),
    ("total_time_s", 0.6, 0.0),
    ("work_lost_s", 1.0, 0.0),
    ("below_10pct_s", 1.0, 3.0),
    ("downtime_ms", 1.0, 0.0),
    ("guest_pause_ms", 1.0, 0.0),
    ("network_pause_ms", 1.0, 0.0),
]
FAMILY_DEFAULTS = ("profiles", "repeats", "memory", "max_time", "link", "storage", "set",
                   "vcpus", "bandwidth", "disk_size", "disk_fill", "stock_qemu")


def _div(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


# ``livemig@stock``: a livemig profile run on the unpatched build (what the profile does
# for a user without livemig's QEMU patches); not a baseline
ON_STOCK = "@stock"


def is_stock(profile: str) -> bool:
    """A stock profile: a baseline, run on the unpatched build."""
    return profile.startswith("upstream") or profile == "defaults"


def base_profile(profile: str) -> str:
    return profile.removesuffix(ON_STOCK)


def on_stock_binary(profile: str) -> bool:
    return is_stock(profile) or profile.endswith(ON_STOCK)


def check_profile(profile: str) -> None:
    if base_profile(profile) not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}: choose from {', '.join(PROFILES)} "
                         f"(a livemig profile with {ON_STOCK} runs on the unpatched build)")


def _check_scenario(sc: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("workload", "memory"):
        if key not in sc:
            raise UsageError(f"{where}: missing '{key}'")
    sc.setdefault("profiles", ["upstream", "livemig"])
    sc.setdefault("repeats", 1)
    if sc.get("storage", "shared") not in ("shared", "copy"):
        raise UsageError(f"{where}: storage must be shared or copy")
    if str(sc.get("link", "1gbit")) != "local":
        try:
            parse_link_rate(str(sc.get("link", "1gbit")))
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
    try:
        parse_workload(sc["workload"])
        parse_size(str(sc["memory"]))
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    for p in sc["profiles"]:
        if base_profile(p) not in PROFILES:
            raise UsageError(f"{where}: unknown profile {p!r}")
    return sc


def load_scenarios(path: Path) -> list[dict[str, Any]]:
    """The scenarios of one file: itself, or each of its ``[[family]]`` tables with
    the file's top-level keys as defaults."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"cannot read scenario {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"bad scenario {path}: {e}") from None
    families = doc.pop("family", None)
    if families is None:
        doc.setdefault("name", path.stem)
        return [_check_scenario(doc, f"scenario {path}")]
    if not isinstance(families, list) or not families:
        raise UsageError(f"scenario {path}: 'family' must be a list of tables")
    out = []
    names: set[str] = set()
    for i, fam in enumerate(families):
        sc = {k: v for k, v in doc.items() if k in FAMILY_DEFAULTS}
        sc.update(fam)
        name = str(sc.setdefault("name", f"{path.stem}-{i + 1}"))
        if name in names:
            raise UsageError(f"scenario {path}: two families are named {name!r}")
        names.add(name)
        out.append(_check_scenario(sc, f"scenario {path}, family {name}"))
    return out


def load_scenario(path: Path) -> dict[str, Any]:
    """A single-scenario file (the first family of a matrix)."""
    return load_scenarios(path)[0]


def binary_label(qemu: Path) -> str:
    """What a QEMU binary is, from the stamp qemu/build.sh writes beside it."""
    stamp = qemu.parent / "stamp"
    try:
        info = dict(line.split("=", 1) for line in stamp.read_text().splitlines()
                    if "=" in line)
    except OSError:
        return str(qemu)
    flavour = "unpatched" if info.get("flavour") == "upstream" else "patched"
    return f"{info.get('version', '?')} {flavour}"


def binaries(sc: dict[str, Any], qemu: Path | None,
             stock_qemu: Path | None) -> tuple[Path, Path]:
    """(patched, stock) binaries for a scenario; stock profiles need the unpatched
    build of the same release unless told otherwise (``--stock-qemu same``)."""
    patched = qemu or paths.default_qemu()
    chosen = stock_qemu
    if chosen is None and sc.get("stock_qemu"):
        chosen = Path(str(sc["stock_qemu"]))
    if chosen is not None and str(chosen) == "same":
        return patched, patched
    stock = chosen or paths.build_dir() / "qemu-upstream" / "qemu-system-x86_64"
    if any(on_stock_binary(p) for p in sc["profiles"]) and not stock.exists():
        raise UsageError(f"stock profiles run on the unpatched build of the same QEMU "
                         f"release, not found at {stock}: run 'make qemu-upstream' (or "
                         "pass --stock-qemu PATH, or --stock-qemu same)")
    return patched, stock


def options_for(sc: dict[str, Any], profile: str, accel: str, reason: str,
                qemu: Path | None, via: str = "lab") -> MigrateOptions:
    """``via``: ``lab`` (the lab's engine hooks) or ``attach`` (the lab boots the VMs
    and hands their QMP sockets to the attach path, as a user's VMs)."""
    sets = {k: str(v) for k, v in sc.get("set", {}).items()}
    wanted = merge(base_profile(profile), sets)
    opts = MigrateOptions(
        workload=parse_workload(sc["workload"]), memory=parse_size(sc["memory"]),
        vcpus=int(sc.get("vcpus", 1)),
        bandwidth=parse_size(sc["bandwidth"]) if sc.get("bandwidth") else None,
        profile=base_profile(profile), wanted=wanted, max_time=float(sc.get("max_time", 300)),
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
    opts.via = via
    return opts


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict[str, list[dict[str, Any]]],
              labels: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for profile, reports in runs.items():
        done = [r for r in reports if r["outcome"] == "completed"]
        row: dict[str, Any] = {"runs": len(reports), "completed": len(done),
                               "binary": (labels or {}).get(profile, "")}
        for name, get in METRICS:
            row[name] = median([get(r) for r in done])
        row["consistency_ok"] = all(r["consistency"]["ram"] in ("ok", "skipped") for r in done)
        out[profile] = row
    return out


def best_baseline(summary: dict[str, dict[str, Any]]) -> str | None:
    """The stock profile to beat: most completions, then shortest median time."""
    stock = [p for p in summary if is_stock(p)]
    if not stock:
        return None
    return min(stock, key=lambda p: (-summary[p]["completed"],
                                     summary[p]["total_time_s"] or float("inf")))


def targets(summary: dict[str, dict[str, Any]], profile: str = "livemig") -> list[str]:
    """The issue's targets for ``profile`` against the best stock profile: one
    'met'/'MISSED' line per target (empty without both rows)."""
    base = best_baseline(summary)
    if base is None or profile not in summary:
        return []
    row, ref = summary[profile], summary[base]
    lines = []
    all_done = row["completed"] == row["runs"]
    lines.append(f"completes every run: {'met' if all_done else 'MISSED'} "
                 f"({row['completed']}/{row['runs']})")
    for col, ratio, floor in TARGETS:
        v, b = row.get(col), ref.get(col)
        if v is None or b is None:
            continue
        limit = max(b * ratio, floor)
        ok = v <= limit + 1e-9
        rel = f"{v / b:.2f}×" if b else "-"
        lines.append(f"{col} ≤ {'max(' + format(floor, 'g') + ', ' if floor else ''}"
                     f"{ratio:g}× stock{')' if floor else ''}: {'met' if ok else 'MISSED'} "
                     f"({v:.3g} vs {b:.3g}, {rel})")
    return lines


def _cell(v: float | None, b: float | None) -> str:
    cell = "-" if v is None else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if v is not None and b:
        cell += f" ({v / b:.2f}×)"
    return cell


def markdown(name: str, desc: str, summary: dict[str, dict[str, Any]]) -> str:
    base = best_baseline(summary)
    cols = [m for m, _ in METRICS
            if m not in OPTIONAL or any(row.get(m) is not None for row in summary.values())]
    lines = [f"### {name}", "", desc, "",
             "| profile | binary | completed | " + " | ".join(cols) + " | RAM check |",
             "|---" * (len(cols) + 4) + "|"]
    for profile, row in summary.items():
        cells = [_cell(row[c], summary[base][c] if base and base != profile else None)
                 for c in cols]
        lines.append(f"| {profile} | {row.get('binary', '')} | "
                     f"{row['completed']}/{row['runs']} | " + " | ".join(cells)
                     + f" | {'ok' if row['consistency_ok'] else 'MISMATCH'} |")
    if base:
        lines += ["", f"Ratios are against `{base}`, the best stock profile in this run "
                      "(medians of completed runs)."]
        met = targets(summary)
        if met:
            lines += ["", "Targets for `livemig`:", ""] + [f"- {m}" for m in met]
    return "\n".join(lines) + "\n"


FLOOR_NOTE = ("Every non-zero page crosses the link at least once: the best stock "
              "profile's first pass (seconds and MiB until its second round began) is "
              "the floor of what any policy can save against it with the same codec. "
              "Where that first pass is more than half its total, the bytes target "
              "(≤ 0.5×) needs the data itself to compress twice as well.\n")


def matrix_markdown(families: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One line per family: the best stock profile and livemig's ratios to it."""
    cols = ["total_time_s", "ram_sent_mib", "work_lost_s", "below_10pct_s",
            "downtime_ms", "guest_pause_ms", "network_pause_ms"]
    lines = ["| family | best stock | stock time s | stock MiB | stock first pass s / MiB | "
             "livemig done | " + " | ".join(f"{c} ×" for c in cols) + " |",
             "|---" * (len(cols) + 6) + "|"]
    for name, summary in families.items():
        base = best_baseline(summary)
        lm = summary.get("livemig")
        if base is None or lm is None:
            continue
        ref = summary[base]
        ratios = []
        for c in cols:
            v, b = lm.get(c), ref.get(c)
            ratios.append("-" if v is None or not b else f"{v / b:.2f}")
        lines.append(f"| {name} | {base} | {_cell(ref['total_time_s'], None)} | "
                     f"{_cell(ref['ram_sent_mib'], None)} | "
                     f"{_cell(ref.get('first_pass_s'), None)} / "
                     f"{_cell(ref.get('first_pass_mib'), None)} | "
                     f"{lm['completed']}/{lm['runs']} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


def switchover_t(report: dict[str, Any]) -> float | None:
    """Seconds after the migration start at which the guest switched over."""
    for sample in report.get("timeline", []):
        if sample.get("status") == "completed":
            return float(sample["t"])
    t = report.get("total_time_s")
    return float(t) if t is not None and report.get("outcome") == "completed" else None


def _median_run(reports: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = sorted((r for r in reports if r["outcome"] == "completed"),
                  key=lambda r: r["total_time_s"] or 0)
    if done:
        return done[len(done) // 2]
    return reports[0] if reports else None


def plot(out_dir: Path, name: str, runs: dict[str, list[dict[str, Any]]],
         summary: dict[str, dict[str, Any]] | None = None) -> list[Path]:
    """Per family: guest throughput of every profile's median run on one chart with
    its switchover marked (plus remaining RAM), and livemig's ratios to the best stock
    profile."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plots")
        return []
    out: list[Path] = []
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    unit = None
    for i, (profile, reports) in enumerate(runs.items()):
        rep = _median_run(reports)
        if rep is None:
            continue
        color = f"C{i}"
        tl = rep["timeline"]
        t = [s["t"] for s in tl]
        per_second = rep["workload"].get("per_second")
        if per_second:  # a service: what its client saw, every second (TPS, ops/s)
            unit = rep["workload"].get("unit")
            axes[0].plot([p["t"] for p in per_second], [p["rate"] for p in per_second],
                         label=profile, color=color, marker=".")
        else:
            axes[0].plot(t, [s.get("guest_rate_pct") or 0 for s in tl], label=profile,
                         color=color)
        axes[1].plot(t, [(s["remaining"] or 0) / (1 << 20) for s in tl], color=color)
        sw = switchover_t(rep)
        if sw is not None:
            for ax in axes:
                ax.axvline(sw, color=color, linestyle="--", linewidth=0.8)
    axes[0].set_ylabel(f"client throughput ({unit})" if unit
                       else "guest throughput (% of normal)")
    axes[1].set_ylabel("remaining RAM (MiB)")
    axes[1].set_xlabel("seconds since migration start (dashed: switchover)")
    axes[0].legend()
    axes[0].set_title(f"{name}: median run of each profile")
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    out.append(path)
    base = best_baseline(summary) if summary else None
    if summary and base and "livemig" in summary:
        cols = [c for c, _, _ in TARGETS]
        vals = []
        for c in cols:
            v, b = summary["livemig"].get(c), summary[base].get(c)
            vals.append(v / b if v is not None and b else 0.0)
        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.bar(cols, vals, color=["C2" if v <= r else "C3"
                                  for v, (_, r, _) in zip(vals, TARGETS, strict=True)])
        for x, (_, r, _) in enumerate(TARGETS):
            ax.hlines(r, x - 0.4, x + 0.4, colors="k", linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_ylabel(f"livemig ÷ {base}")
        ax.set_title(f"{name}: livemig vs best stock (black: target)")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
        path = out_dir / f"{name}-ratios.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        out.append(path)
    return out


async def run_bench(scenarios: list[Path], out_dir: Path, accel: str, reason: str,
                    qemu: Path | None, repeats: int | None,
                    profiles: list[str] | None, quiet: bool,
                    stock_qemu: Path | None = None, reuse: str = "no",
                    names: list[str] | None = None, via: str = "lab") -> str:
    """``reuse``: ``no`` runs everything; ``resume`` takes the reports already in
    ``out_dir`` and runs the missing ones; ``only`` just summarizes what is there.
    ``names``: the families to run (default: every one of the files)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    families = [sc for path in scenarios for sc in load_scenarios(path)
                if names is None or sc["name"] in names]
    plans = []
    for sc in families:  # every binary is checked before the first run
        profs = profiles or list(sc["profiles"])
        sc = {**sc, "profiles": profs}
        plans.append((sc, binaries(sc, qemu, stock_qemu)))
    md_parts = []
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    for sc, (patched, stock) in plans:
        profs = list(sc["profiles"])
        n = repeats or int(sc["repeats"])
        bins = {p: stock if on_stock_binary(p) else patched for p in profs}
        labels = {p: binary_label(b) for p, b in bins.items()}
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in profs}
        with contextlib.ExitStack() as family_stack:
            if via == "libvirt" and reuse != "only":
                from livemig import bench_libvirt

                family_stack.enter_context(bench_libvirt.testbed(
                    str(sc.get("link", "1gbit")), sorted(set(bins.values()))))
            await _run_family(sc, profs, n, bins, labels, runs, out_dir, accel, reason, via,
                              reuse, quiet)
        if reuse == "only":  # --summarize: only what was run
            runs = {p: r for p, r in runs.items() if r}
            if not runs:
                continue
        summary = summarize(runs, labels)
        summaries[sc["name"]] = summary
        md_parts.append(markdown(sc["name"], sc.get("description", ""), summary))
        (out_dir / f"{sc['name']}-summary.json").write_text(json.dumps(summary, indent=2))
        for png in plot(out_dir, sc["name"], runs, summary):
            md_parts.append(f"![{png.stem}]({png.name})\n")
    if len(summaries) > 1:
        md_parts.insert(0, "## Matrix: livemig ÷ best stock profile per family\n\n"
                        + matrix_markdown(summaries) + "\n" + FLOOR_NOTE)
    md = "\n".join(md_parts)
    (out_dir / "summary.md").write_text(md)
    return md


async def _run_family(sc: dict[str, Any], profs: list[str], n: int, bins: dict[str, Path],
                      labels: dict[str, str], runs: dict[str, list[dict[str, Any]]],
                      out_dir: Path, accel: str, reason: str, via: str, reuse: str,
                      quiet: bool) -> None:
    """The family's runs, profiles interleaved within each repeat."""
    for i in range(n):
        for p in profs:
            path = out_dir / f"{sc['name']}-{p}-{i + 1}.json"
            if reuse != "no" and path.exists():
                runs[p].append(json.loads(path.read_text()))
                continue
            if reuse == "only":
                continue
            print(f"== bench {sc['name']}: {p} run {i + 1}/{n} ({labels[p]})",
                  flush=True)
            if via == "libvirt":
                from livemig.bench_libvirt import LibvirtRun

                runs_dir = out_dir / "libvirt-runs"
                runs_dir.mkdir(exist_ok=True)
                rep = await LibvirtRun(sc, p, base_profile(p), bins[p], runs_dir, quiet).run()
            else:
                mig = LabRun(options_for(sc, p, accel, reason, bins[p], via),
                             Progress(enabled=not quiet))
                await mig.run()
                rep = mig.report()
            rep["bench"] = {"family": sc["name"], "profile": p, "repeat": i + 1, "via": via,
                            "binary": labels[p], "qemu": str(bins[p])}
            write_report(rep, path)
            runs[p].append(rep)
            print(f"   {rep['outcome']} in {rep['total_time_s']}s", flush=True)
