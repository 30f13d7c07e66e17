"""The evacuation benchmark on the testbed (not a test):
``python -m livemig.evacuate.bench OUT_DIR [--repeats 3] [--count 5] [--link 100mbit]``.

The same fleet (``testbed fleet``: idle, small-write busy, whole-page writer, cycled),
defined afresh for every run, evacuated from src to dst and dst2 by:
``fixed:1`` (Nova's default), ``fixed:2`` (KubeVirt's per node) and ``fixed:N`` (all
at once), each with the best stock profile (``upstream``) on the unpatched QEMU,
and ``livemig evacuate`` with its profile on the patched build. Repeats interleave
the four; the Markdown table has medians. Needs the testbed up with ``--libvirt
--hosts 2`` and the lock (``flock /tmp/livemig-vm.lock``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from livemig import paths
from livemig.evacuate import testfleet
from livemig.testbed import libvirtd, topology
from livemig.units import parse_link_rate

MEMORY_MIB = 128
BOOT_S = 8.0  # booted and the writers running


def configs(count: int, only: list[str] | None = None) -> list[tuple[str, str, str, Path]]:
    """The issue's four configurations; with ``only``, those named, which may also be
    the ablation ``livemig-upstream``: livemig's scheduler with the stock profile on
    the stock QEMU (what the scheduler alone does against ``fixed:N``)."""
    stock = paths.build_dir() / "qemu-upstream" / "qemu-system-x86_64"
    main = [(f"fixed:{n}", f"fixed:{n}", "upstream", stock) for n in (1, 2, count)] + [
        ("livemig", "livemig", "livemig", paths.default_qemu())]
    if only is None:
        return main
    extra = [("livemig-upstream", "livemig", "upstream", stock)]
    return [c for c in main + extra if c[0] in only]


def one(out: Path, name: str, scheduler: str, profile: str, qemu: Path,
        count: int) -> dict[str, Any]:
    prefix = f"bench{int(time.time()) % 100000}"
    names = list(testfleet.define(count, MEMORY_MIB, prefix, qemu))
    try:
        time.sleep(BOOT_S)
        cmd = [sys.executable, "-m", "livemig.cli", "evacuate", "--connect", libvirtd.uri("src"),
               "--to", f"{libvirtd.uri('dst')},{libvirtd.uri('dst2')}", "--unsafe", "-q",
               "--scheduler", scheduler, "--profile", profile, "--report", str(out)]
        # a crash in C (libvirt, a segfault) still leaves a Python stack in stdout.txt
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
        (out / "stdout.txt").write_text(p.stdout + p.stderr + f"\nexit {p.returncode}\n")
        try:
            rep: dict[str, Any] = json.loads((out / "evacuation.json").read_text())
        except (OSError, ValueError):  # it died before its report: a failed run, noted
            rep = {"outcome": f"no report (exit {p.returncode})", "time_to_empty_s": None,
                   "bytes": 0, "longest_pause_ms": None, "expected_s": None,
                   "verified": 0, "vms": []}
        rep["exit"] = p.returncode
        return rep
    finally:
        testfleet.remove(names)


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def med(xs: list[float | None]) -> str:
        v = [x for x in xs if x is not None]
        return f"{statistics.median(v):.1f}" if v else "-"
    lines = ["| scheduler | runs | time to empty s (median) | all | RAM sent MiB | "
             "longest pause ms | planned s | measured before, s | verified | emptied |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, reps in runs.items():
        t = [r["time_to_empty_s"] for r in reps]
        lines.append(
            f"| {name} | {len(reps)} | {med(t)} | "
            f"{', '.join('-' if x is None else f'{x:.1f}' for x in t)} | "
            f"{med([r['bytes'] / 2**20 for r in reps])} | "
            f"{med([r['longest_pause_ms'] for r in reps])} | "
            f"{med([r['expected_s'] for r in reps])} | "
            f"{med([r.get('measure_s') for r in reps])} | "
            f"{', '.join(str(r['verified']) + '/' + str(len(r['vms'])) for r in reps)} | "
            f"{sum(1 for r in reps if r['outcome'] == 'emptied')}/{len(reps)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m livemig.evacuate.bench")
    ap.add_argument("out", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--link", default="100mbit")
    ap.add_argument("--only", help="these configurations only (comma-separated names)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    with topology.locked(wait=600):
        created = not topology.is_up()
        link = parse_link_rate(a.link)
        if created:
            topology.up(link, owner="evacuate bench")
        else:
            topology.set_link(link)
        added = topology.add_dst2(link)
        if not added:
            topology.set_link(link)
        libvirtd.up()
        try:
            for r in range(a.repeats):
                for name, sched, profile, qemu in configs(
                        a.count, a.only.split(",") if a.only else None):
                    d = a.out / f"{name.replace(':', '-')}-{r}"
                    d.mkdir(parents=True, exist_ok=True)
                    rep = one(d, name, sched, profile, qemu, a.count)
                    runs.setdefault(name, []).append(rep)
                    print(f"{name} #{r}: {rep['outcome']}, time to empty "
                          f"{rep['time_to_empty_s']}, exit {rep['exit']}", flush=True)
        finally:
            libvirtd.down()
            if created:
                topology.down(quiet=True)
            elif added:
                topology.remove_dst2()
    md = table(runs)
    (a.out / "summary.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
