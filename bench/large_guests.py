#!/usr/bin/env python3
"""Cost of a migration against guest size (issue 15, part 1).

For guests of 1, 4, 8, 16 GiB (mostly idle RAM, a modest hot-set writer; an idle
series too) this migrates each size with the stock ``upstream`` profile on the
unpatched QEMU and the ``livemig`` profile on the patched one, interleaved and
repeated, through ``livemig migrate --qemu-trace bitmap`` (QEMU's own trace points:
every dirty-bitmap sync and each step of the final pause), and times QEMU's start
with and without preallocated RAM. It writes the raw figures as JSON, a Markdown table
of medians and a plot of each figure against RAM size.

    nice -n 19 .venv/bin/python bench/large_guests.py --out docs/results/large-guests
    nice -n 19 .venv/bin/python bench/large_guests.py --render docs/results/large-guests

Each migration is a separate ``livemig migrate`` process (the same path users take);
the JSON is rewritten after every run, so an interrupted study keeps what it measured
and ``--resume`` skips what is already there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LIVEMIG = ROOT / ".venv" / "bin" / "livemig"
PATCHED = ROOT / "build" / "qemu" / "qemu-system-x86_64"
STOCK = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"
GIB = 1 << 30

#: profile -> binary it runs on (stock behaviour on the unpatched build)
PROFILES: dict[str, Path] = {"upstream": STOCK, "livemig": PATCHED}
WRITER = "mem:size=256M,rate=32M,hot=80/10"
#: figures kept per run (see :func:`figures`), in table order
FIGURES: tuple[tuple[str, str], ...] = (
    ("total_s", "total time (s)"),
    ("first_byte_s", "time to first byte (s)"),
    ("sync_ms", "bitmap sync per live round (ms, median)"),
    ("final_sync_ms", "bitmap sync in the final pause (ms)"),
    ("downtime_ms", "QEMU downtime (ms)"),
    ("guest_pause_ms", "guest-visible pause (ms)"),
    ("dst_load_ms", "destination load after source done (ms)"),
    ("ram_complete_ms", "RAM save in the final pause (ms)"),
    ("mig_cpu_s_per_gib", "migration-thread CPU (s per GiB)"),
    ("dst_cpu_s_per_gib", "destination QEMU CPU (s per GiB)"),
    ("sent_mib", "RAM sent (MiB)"),
    ("rounds", "rounds (dirty syncs)"),
    ("boot_s", "QEMU exec -> guest agent ready (s)"),
    ("drain_count", "switchover drains (x-switchover-drain)"),
    ("drain_ms", "time in drains, guest running (ms)"),
)


# -- one migration -------------------------------------------------------------------
def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The study's figures from one ``livemig migrate`` report (pure)."""
    s = report.get("settings") or {}
    gib = (s.get("memory") or 0) / GIB
    tr = report.get("qemu_trace") or {}
    steps = tr.get("downtime_steps_ms") or {}
    cpus = report.get("cpu_seconds") or {}
    cpu = cpus.get("source_migration_threads")
    sent = report.get("ram_transferred_bytes")
    drain = (report.get("qemu_final_stats") or {}).get("x-switchover-drain") or {}
    boot = next((e.get("boot_s") for e in report.get("events") or []
                 if e.get("event") == "guest ready"), None)
    return {
        "outcome": report.get("outcome"),
        "ram_check": (report.get("consistency") or {}).get("ram"),
        "total_s": report.get("total_time_s"),
        "first_byte_s": tr.get("first_byte_s"),
        "sync_ms": tr.get("sync_ms_median"),
        "final_sync_ms": tr.get("final_sync_ms"),
        "sync_count": tr.get("sync_count"),
        "downtime_ms": report.get("downtime_ms"),
        "guest_pause_ms": report.get("guest_pause_ms"),
        "dst_load_ms": steps.get("dst_load"),
        "ram_complete_ms": tr.get("ram_save_complete_ms"),
        "mig_cpu_s": cpu,
        "mig_cpu_s_per_gib": round(cpu / gib, 3) if cpu is not None and gib else None,
        "sent_mib": round(sent / (1 << 20), 1) if sent is not None else None,
        "rounds": report.get("rounds"),
        "boot_s": boot,
        "drain_count": drain.get("count"),
        "drain_ms": drain.get("time-ms"),
        "dst_cpu_s_per_gib": (round(cpus["destination"] / gib, 3)
                              if cpus.get("destination") is not None and gib else None),
        "encoding": (report.get("encoding") or {}).get("encoding"),
        "multifd": ((s.get("capabilities") or {}).get("multifd")),
        "downtime_steps_ms": steps,
        "syncs": tr.get("syncs"),
    }


def migrate(size_g: int, profile: str, workload: str, link: str, work: Path,
            max_time: float) -> dict[str, Any]:
    """One ``livemig migrate`` run; its figures (or the failure)."""
    report = work / f"r-{size_g}g-{profile.replace(':', '_')}-{int(time.time() * 1000)}.json"
    base, _, sets = profile.partition(":")
    base = base.partition("@")[0]  # PROFILE@LABEL: the same profile, kept apart
    argv = [str(LIVEMIG), "migrate", "-q", "--memory", f"{size_g}G", "--workload", workload,
            "--link", link, "--profile", base, "--qemu", str(PROFILES[base]),
            "--qemu-trace", "bitmap", "--max-time", str(max_time), "--report", str(report)]
    for kv in filter(None, sets.split("+")):
        argv += ["--set", kv]
    env = dict(os.environ)
    env.setdefault("LIVEMIG_TESTBED_WAIT", "1800")
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    out: dict[str, Any] = {"size_gib": size_g, "profile": profile, "workload": workload,
                           "link": link, "exit": proc.returncode,
                           "wall_s": round(time.time() - t0, 1)}
    try:
        out.update(figures(json.loads(report.read_text())))
    except (OSError, ValueError):
        out["outcome"] = "failed"
        out["error"] = (proc.stderr or proc.stdout).strip()[-400:]
    return out


# -- QEMU start time -----------------------------------------------------------------
async def _start_once(size_g: int, prealloc_threads: int) -> dict[str, Any]:
    """exec -> QMP ready -> guest agent ready, RAM preallocated or not."""
    from livemig import paths
    from livemig.lab.agent import AgentLink
    from livemig.lab.vm import VM, VMConfig

    run_dir = Path(tempfile.mkdtemp(prefix="large-start-", dir="/run"))
    mem = paths.shm_root() / f"livemig-large-start-{os.getpid()}.ram"
    cfg = VMConfig(name="start", run_id="large", qemu=PATCHED, memory=size_g * GIB, vcpus=1,
                   accel="tcg", kernel=paths.guest_kernel(), initrd=paths.guest_initrd(),
                   append="console=ttyS0 quiet livemig.workload=idle", run_dir=run_dir,
                   mem_path=mem, prealloc_threads=prealloc_threads)
    vm = VM(cfg)
    res: dict[str, Any] = {"size_gib": size_g, "prealloc_threads": prealloc_threads}
    try:
        t0 = time.time()
        vm.start()
        await vm.connect(timeout=600)
        res["qmp_ready_s"] = round(time.time() - t0, 3)
        agent = AgentLink("start", cfg.agent_path)
        await agent.connect(timeout=120)
        await asyncio.wait_for(agent.ready.wait(), 180)
        res["guest_ready_s"] = round(time.time() - t0, 3)
        await agent.close()
    except (OSError, TimeoutError, Exception) as e:  # a failed start is a result too
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(Exception):
            await vm.stop()
        with contextlib.suppress(FileNotFoundError):
            mem.unlink()
        shutil.rmtree(run_dir, ignore_errors=True)
    return res


def start_time(size_g: int, prealloc_threads: int) -> dict[str, Any]:
    return asyncio.run(_start_once(size_g, prealloc_threads))


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# -- aggregation, table, plot ----------------------------------------------------------
def median(values: Iterable[Any]) -> float | None:
    vs = [float(v) for v in values if isinstance(v, (int, float))]
    return round(statistics.median(vs), 3) if vs else None


def _series(run: dict[str, Any]) -> str:
    """Runs over different links are kept apart (the link changes the sender's CPU)."""
    return f"{run.get('series', 'writer')}, link {run.get('link', '?')}"


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (series, profile, size) over completed runs."""
    keys = sorted({(_series(r), r["profile"], r["size_gib"]) for r in runs},
                  key=lambda k: (not k[0].startswith("writer"), k[0], k[1], k[2]))
    rows = []
    for series, profile, size in keys:
        rs = [r for r in runs if (_series(r), r["profile"], r["size_gib"])
              == (series, profile, size)]
        ok = [r for r in rs if r.get("outcome") == "completed"]
        row: dict[str, Any] = {"series": series, "profile": profile, "size_gib": size,
                               "runs": len(rs), "completed": len(ok),
                               "ram_ok": sum(1 for r in ok if r.get("ram_check") == "ok"),
                         "link": rs[0].get("link")}
        for key, _ in FIGURES:
            row[key] = median(r.get(key) for r in ok)
        rows.append(row)
    return rows


def sync_by_size(runs: Sequence[dict[str, Any]]) -> dict[int, list[float]]:
    """Every traced bitmap sync's duration (ms), by guest size."""
    out: dict[int, list[float]] = {}
    for r in runs:
        for sync in r.get("syncs") or []:
            if isinstance(sync.get("ms"), (int, float)):
                out.setdefault(int(r["size_gib"]), []).append(float(sync["ms"]))
    return out


def sync_slope(pooled: dict[int, list[float]]) -> float | None:
    """ms per GiB: least-squares slope of the per-size medians."""
    pts = [(float(k), statistics.median(v)) for k, v in pooled.items() if v]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def aggregate_starts(starts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = sorted({(s["size_gib"], s["prealloc_threads"]) for s in starts})
    rows = []
    for size, threads in keys:
        ss = [s for s in starts if (s["size_gib"], s["prealloc_threads"]) == (size, threads)
              and "error" not in s]
        rows.append({"size_gib": size, "prealloc_threads": threads, "runs": len(ss),
                     "qmp_ready_s": median(s.get("qmp_ready_s") for s in ss),
                     "guest_ready_s": median(s.get("guest_ready_s") for s in ss)})
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def markdown(data: dict[str, Any]) -> str:
    rows = aggregate(data["runs"])
    meta = data.get("meta", {})
    links: dict[str, int] = {}
    for r in data["runs"]:
        links[r.get("link", "?")] = links.get(r.get("link", "?"), 0) + 1
    out = [f"Measured {meta.get('date', '?')} on {meta.get('host', '?')}, accel TCG, links "
           + ", ".join(f"`{k}` ({v} runs)" for k, v in links.items())
           + f", writer `{meta.get('workload', WRITER)}`; medians of "
           f"{meta.get('repeats', '?')} interleaved runs (idle series: "
           f"{meta.get('idle_repeats', 0)}).", ""]
    for series in dict.fromkeys(r["series"] for r in rows):
        for profile in dict.fromkeys(r["profile"] for r in rows if r["series"] == series):
            sub = [r for r in rows if r["series"] == series and r["profile"] == profile]
            out += [f"### {series}: `{profile}`", "",
                    "| figure | " + " | ".join(f"{r['size_gib']} GiB" for r in sub) + " |",
                    "|---|" + "---|" * len(sub)]
            out.append("| runs completed / RAM ok | " + " | ".join(
                f"{r['completed']}/{r['runs']} / {r['ram_ok']}" for r in sub) + " |")
            for key, label in FIGURES:
                out.append(f"| {label} | " + " | ".join(_fmt(r[key]) for r in sub) + " |")
            out.append("")
    pooled = sync_by_size(data["runs"])
    if pooled:
        slope = sync_slope(pooled)
        out += ["### Every bitmap sync, pooled over runs and profiles", "",
                "| RAM | syncs | median (ms) | p90 (ms) | max (ms) |", "|---|---|---|---|---|"]
        for size, ms in sorted(pooled.items()):
            qs = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else ms * 9
            out.append(f"| {size} GiB | {len(ms)} | {statistics.median(ms):.3f} | "
                       f"{qs[-1]:.3f} | {max(ms):.3f} |")
        out += ["", f"Least-squares slope of the median against RAM: "
                f"{slope * 1000:.1f} µs per GiB per sync." if slope is not None else "", ""]
    srows = aggregate_starts(data.get("starts", []))
    if srows:
        out += ["### QEMU start (patched binary, TCG, RAM file in /dev/shm)", "",
                "| RAM | prealloc threads | runs | exec -> QMP ready (s) | "
                "exec -> guest agent ready (s) |", "|---|---|---|---|---|"]
        for r in srows:
            out.append(f"| {r['size_gib']}G | {r['prealloc_threads'] or 'off'} | {r['runs']} | "
                       f"{_fmt(r['qmp_ready_s'])} | {_fmt(r['guest_ready_s'])} |")
        out.append("")
    return "\n".join(out)


def plot(data: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = aggregate(data["runs"])
    panels = ["total_s", "first_byte_s", "sync_ms", "final_sync_ms", "downtime_ms",
              "guest_pause_ms", "mig_cpu_s_per_gib", "start"]
    labels = dict(FIGURES)
    colors = {p: f"C{i}" for i, p in enumerate(dict.fromkeys(r["profile"] for r in rows))}
    styles = {s: ls for s, ls in zip(dict.fromkeys(r["series"] for r in rows),
                                      ("-", ":", "--", "-.") * 4, strict=False)}
    fig, axes = plt.subplots(2, 4, figsize=(18, 8.5))
    for ax, key in zip(axes.flat, panels, strict=True):
        if key == "start":
            srows = aggregate_starts(data.get("starts", []))
            for i, threads in enumerate(sorted({r["prealloc_threads"] for r in srows})):
                sub = [r for r in srows if r["prealloc_threads"] == threads
                       and r["qmp_ready_s"] is not None]
                name = f"prealloc, {threads} thread(s)" if threads else "no prealloc"
                ax.plot([r["size_gib"] for r in sub], [r["qmp_ready_s"] for r in sub],
                        marker="o", color=f"C{i}", label=f"{name}: exec -> QMP")
                ax.plot([r["size_gib"] for r in sub], [r["guest_ready_s"] for r in sub],
                        marker="x", ls=":", color=f"C{i}", label=f"{name}: exec -> guest")
            ax.set_title("QEMU start time (s)", fontsize=9)
        else:
            for series in styles:
                for profile in colors:
                    pts = [(r["size_gib"], r[key]) for r in rows if r["series"] == series
                           and r["profile"] == profile and r[key] is not None]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                color=colors[profile], ls=styles[series],
                                label=f"{profile} ({series})")
            ax.set_title(labels[key], fontsize=9)
        ax.set_xlabel("guest RAM (GiB)")
        ax.set_xticks([1, 4, 8, 16])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=5.5)
    fig.suptitle("Migration cost against guest size (TCG, 2-core host)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# -- main ------------------------------------------------------------------------------
def _save(data: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out.with_suffix(".json"))


BEGIN, END = "<!-- large_guests.py: begin -->", "<!-- large_guests.py: end -->"


def render(out: Path) -> None:
    """STEM.png, and the tables into STEM.md between the markers (the prose around
    them is kept; a new STEM.md is the tables alone)."""
    data = json.loads(out.with_suffix(".json").read_text())
    md = out.with_suffix(".md")
    table = f"{BEGIN}\n{markdown(data)}\n{END}"
    text = md.read_text() if md.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + table + "\n"
    md.write_text(text)
    plot(data, out.with_suffix(".png"))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/large-guests",
                   help="output stem: STEM.json, STEM.md (tables), STEM.png")
    p.add_argument("--sizes", default="1,4,8,16", help="guest sizes in GiB")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--idle-repeats", type=int, default=1, help="idle series (0: none)")
    p.add_argument("--link", default="10gbit", help="testbed link (or 'local')")
    p.add_argument("--workload", default=WRITER)
    p.add_argument("--profiles", default="upstream,livemig,livemig:encoding=lz4",
                   help="profiles; PROFILE:key=value+key=value adds --set options, "
                   "PROFILE@LABEL keeps runs of another code version apart")
    p.add_argument("--exclude", default="16:livemig",
                   help="SIZE:PROFILE pairs not to run (default: the livemig profile's xbzrle "
                   "path touches every destination page, 16 GiB on both ends is over the "
                   "host's budget)")
    p.add_argument("--prealloc", default="0,1,2", help="prealloc-threads to time (0 = off)")
    p.add_argument("--start-repeats", type=int, default=1)
    p.add_argument("--max-time", type=float, default=900.0)
    p.add_argument("--skip", default="", help="comma list: migrate,idle,start")
    p.add_argument("--resume", action="store_true", help="keep runs already in STEM.json")
    p.add_argument("--render", action="store_true", help="only redraw table and plot")
    a = p.parse_args(argv)
    if a.render:
        render(a.out)
        return 0
    sizes = [int(s) for s in a.sizes.split(",")]
    profiles = a.profiles.split(",")
    skip = set(a.skip.split(",")) - {""}
    exclude = set(a.exclude.split(",")) - {""}
    data: dict[str, Any] = {"meta": {}, "runs": [], "starts": []}
    if a.resume and a.out.with_suffix(".json").exists():
        data = json.loads(a.out.with_suffix(".json").read_text())
    data["meta"].update({"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename,
                         "link": a.link, "workload": a.workload, "repeats": a.repeats,
                         "idle_repeats": a.idle_repeats, "sizes": sizes})
    work = Path(tempfile.mkdtemp(prefix="large-guests-"))

    def have(series: str, size: int, profile: str, rep: int) -> bool:
        return sum(1 for r in data["runs"]
                   if (r.get("series"), r["size_gib"], r["profile"], r.get("link"))
                   == (series, size, profile, a.link)) > rep

    plan: list[tuple[str, str, int]] = []
    if "migrate" not in skip:
        plan += [("writer", a.workload, r) for r in range(a.repeats)]
    if "idle" not in skip:
        plan += [("idle", "idle", r) for r in range(a.idle_repeats)]
    for series, workload, rep in plan:
        for size in sizes:
            for profile in profiles if rep % 2 == 0 else list(reversed(profiles)):
                if have(series, size, profile, rep) or f"{size}:{profile}" in exclude:
                    continue
                r = migrate(size, profile, workload, a.link, work, a.max_time)
                r.update(series=series, repeat=rep)
                data["runs"].append(r)
                print(f"{series} {size}G {profile}#{rep}: {r.get('outcome')} "
                      f"total {r.get('total_s')} s, first byte {r.get('first_byte_s')} s, "
                      f"sync {r.get('sync_ms')} / final {r.get('final_sync_ms')} ms, "
                      f"downtime {r.get('downtime_ms')} ms, pause {r.get('guest_pause_ms')} ms,"
                      f" cpu/GiB {r.get('mig_cpu_s_per_gib')} [{r['wall_s']} s]", flush=True)
                _save(data, a.out)
    if "start" not in skip:
        for rep in range(a.start_repeats):
            for size in sizes:
                for threads in [int(t) for t in a.prealloc.split(",")]:
                    if sum(1 for s in data["starts"] if (s["size_gib"], s["prealloc_threads"])
                           == (size, threads)) > rep:
                        continue
                    # preallocation touches all of it: only with room to spare
                    if threads and mem_available() < (size + 3) * GIB:
                        data["starts"].append({"size_gib": size, "prealloc_threads": threads,
                                               "error": "skipped: not enough free memory"})
                        continue
                    s = start_time(size, threads)
                    data["starts"].append(s)
                    print(f"start {size}G prealloc={threads}: {s}", flush=True)
                    _save(data, a.out)
    _save(data, a.out)
    render(a.out)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
