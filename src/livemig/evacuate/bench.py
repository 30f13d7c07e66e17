"""The evacuation benchmark on the testbed (not a test):
``python -m livemig.evacuate.bench OUT_DIR [--repeats 3] [--count 5] [--link 100mbit]
[--fleet mixed|busy] [--stock-profile upstream[,upstream-xbzrle]]``.

The same fleet (``testbed fleet``, its kind's workloads cycled), defined afresh for
every run, evacuated from src to dst and dst2 by: ``fixed:1`` (Nova's default),
``fixed:2`` (KubeVirt's per node) and ``fixed:N`` (all at once), each with a stock
profile on the unpatched QEMU (several: each configuration once per profile, named
``fixed:N@profile``), and ``livemig evacuate`` with its profile on the patched build.
Repeats interleave the configurations; the Markdown table has medians. Every guest's
harm is read from its agent on whichever host it runs (``harm.FleetWatch``), the
same way for every configuration. Needs root and the lock (``flock
/tmp/livemig-vm.lock``); brings the testbed up with two destinations if it is down.
"""

from __future__ import annotations

import argparse
import asyncio
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
from livemig.evacuate.harm import FleetWatch, split, totals
from livemig.testbed import libvirtd, topology
from livemig.units import parse_link_rate

MEMORY_MIB = 128
BOOT_TIMEOUT_S = 180.0  # five TCG guests booting at once on two cores
WARMUP_S = 5.0  # after every agent said ready: the normal rate's window
TIMEOUT_S = 1200.0  # one evacuation


def configs(count: int, only: list[str] | None = None,
            stock_profiles: tuple[str, ...] = ("upstream",)) -> list[tuple[str, str, str, Path]]:
    """The issue's four configurations (fixed:1, fixed:2, fixed:N, each once per stock
    profile, and livemig); with ``only``, those named, which may also be the ablations
    ``livemig-upstream``: livemig's scheduler with the stock profile on the stock QEMU
    (what the scheduler alone does against ``fixed:N``), and ``fixed:N@livemig``: a
    fixed concurrency with livemig's profile on the patched build (what the profile
    alone does, and what a slower drain costs the guests)."""
    stock = paths.build_dir() / "qemu-upstream" / "qemu-system-x86_64"
    many = len(stock_profiles) > 1
    main = [(f"fixed:{n}" + (f"@{p}" if many else ""), f"fixed:{n}", p, stock)
            for n in (1, 2, count) for p in stock_profiles] + [
        ("livemig", "livemig", "livemig", paths.default_qemu())]
    if only is None:
        return main
    extra = [("livemig-upstream", "livemig", "upstream", stock)] + [
        (f"fixed:{n}@livemig", f"fixed:{n}", "livemig", paths.default_qemu())
        for n in (1, 2, count)]
    return [c for c in main + extra if c[0] in only]


def one(out: Path, name: str, scheduler: str, profile: str, qemu: Path,
        count: int, kind: str = "mixed", memory_mib: int = MEMORY_MIB) -> dict[str, Any]:
    prefix = f"bench{int(time.time()) % 100000}"
    names = list(testfleet.define(count, memory_mib, prefix, qemu, kind))
    try:
        return asyncio.run(_watched(out, names, scheduler, profile))
    finally:
        testfleet.remove(names)


async def _watched(out: Path, names: list[str], scheduler: str,
                   profile: str) -> dict[str, Any]:
    """The evacuation as a child process, with every guest's agent watched from boot
    to a settle after the evacuation's end."""
    watch = FleetWatch(names)
    try:
        await watch.start()
        await watch.wait_ready(BOOT_TIMEOUT_S)
        await asyncio.sleep(WARMUP_S)
        watch.follow()
        cmd = [sys.executable, "-m", "livemig.cli", "evacuate", "--connect", libvirtd.uri("src"),
               "--to", f"{libvirtd.uri('dst')},{libvirtd.uri('dst2')}", "--unsafe", "-q",
               "--scheduler", scheduler, "--profile", profile, "--report", str(out)]
        # a crash in C (libvirt, a segfault) still leaves a Python stack in stdout.txt
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        t0 = time.time()
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            stdout, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            stdout, _ = await proc.communicate()
        t1 = time.time()
        (out / "stdout.txt").write_text(stdout.decode(errors="replace")
                                        + f"\nexit {proc.returncode}\n")
        try:
            rep: dict[str, Any] = json.loads((out / "evacuation.json").read_text())
        except (OSError, ValueError):  # it died before its report: a failed run, noted
            rep = {"outcome": f"no report (exit {proc.returncode})", "time_to_empty_s": None,
                   "bytes": 0, "longest_pause_ms": None, "expected_s": None,
                   "verified": 0, "vms": []}
        await asyncio.sleep(2.5)  # the harm window's settle (harm.SETTLE_S) is seen
        rep["exit"] = proc.returncode
        rep["harm"] = watch.summary(t0, t1)
        if rep.get("started_at"):  # where each VM lost its work: its own migration or not
            rep["harm"]["split"] = split(rep["harm"]["vms"], rep.get("vms") or [],
                                         float(rep["started_at"]) - t0)
        (out / "harm.json").write_text(json.dumps(rep["harm"], indent=2) + "\n")
        return rep
    finally:
        await watch.close()


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def med(xs: list[float | None]) -> str:
        v = [x for x in xs if x is not None]
        return f"{statistics.median(v):.1f}" if v else "-"
    def harm(r: dict[str, Any], key: str) -> float | None:
        v = (r.get("harm") or {}).get(key)
        return None if v is None else float(v)

    def net(r: dict[str, Any]) -> float | None:
        """The fleet's work lost without the clipping, from its VMs' figures (their
        rate series in runs recorded before it was kept)."""
        net_sum: float | None = totals((r.get("harm") or {}).get("vms") or {})[
            "work_lost_net_sum_s"]
        return net_sum

    def outside(r: dict[str, Any]) -> float | None:
        sp = (r.get("harm") or {}).get("split")
        return None if not sp else float(sp["before"]) + float(sp["after"])

    def starting(r: dict[str, Any]) -> float | None:
        """Lost in the VM's own migration before its first byte (the children's start
        and libvirt's prepare: destination QEMUs starting on the testbed's cores)."""
        sp = (r.get("harm") or {}).get("split") or {}
        return None if sp.get("starting") is None else float(sp["starting"])
    def whole(r: dict[str, Any]) -> float | None:
        """The drain and the measurement before it: what the operator waits for
        (a fixed-concurrency scheduler needs no page sample; the bench measures its
        fleet all the same, for the placement by wire bytes)."""
        t, m = r.get("time_to_empty_s"), r.get("measure_s")
        return None if t is None or m is None else float(t) + float(m)
    lines = ["| scheduler | runs | time to empty s (median) | all | with the measurement "
             "before it, s | RAM sent MiB | "
             "work lost s, sum | unclipped | of it outside the VM's own migration | "
             "of it before the VM's first byte | worst VM | "
             "worst < 10 % s | guest pause ms, worst | "
             "QEMU downtime ms, longest | planned s | measured before, s | verified | "
             "emptied |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- | --- | --- | --- |"]
    for name, reps in runs.items():
        t = [r["time_to_empty_s"] for r in reps]
        lines.append(
            f"| {name} | {len(reps)} | {med(t)} | "
            f"{', '.join('-' if x is None else f'{x:.1f}' for x in t)} | "
            f"{med([whole(r) for r in reps])} | "
            f"{med([r['bytes'] / 2**20 for r in reps])} | "
            f"{med([harm(r, 'work_lost_sum_s') for r in reps])} | "
            f"{med([net(r) for r in reps])} | "
            f"{med([outside(r) for r in reps])} | "
            f"{med([starting(r) for r in reps])} | "
            f"{med([harm(r, 'work_lost_worst_s') for r in reps])} | "
            f"{med([harm(r, 'below_10pct_worst_s') for r in reps])} | "
            f"{med([harm(r, 'guest_pause_worst_ms') for r in reps])} | "
            f"{med([r['longest_pause_ms'] for r in reps])} | "
            f"{med([r['expected_s'] for r in reps])} | "
            f"{med([r.get('measure_s') for r in reps])} | "
            f"{', '.join(str(r['verified']) + '/' + str(len(r['vms'])) for r in reps)} | "
            f"{sum(1 for r in reps if r['outcome'] == 'emptied')}/{len(reps)} |")
    return "\n".join(lines)


def collected(out: Path) -> dict[str, list[dict[str, Any]]]:
    """The runs kept in ``out``: each ``CONFIG-REPEAT/`` directory's evacuation report
    with its harm, grouped by CONFIG."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for d in sorted(p for p in out.iterdir() if p.is_dir()):
        try:
            rep: dict[str, Any] = json.loads((d / "evacuation.json").read_text())
            rep["harm"] = json.loads((d / "harm.json").read_text())
        except (OSError, ValueError):
            continue
        runs.setdefault(d.name.rsplit("-", 1)[0], []).append(rep)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m livemig.evacuate.bench")
    ap.add_argument("out", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--link", default="100mbit")
    ap.add_argument("--only", help="these configurations only (comma-separated names)")
    ap.add_argument("--fleet", choices=sorted(testfleet.FLEETS), default="mixed",
                    help="the fleet's kind (testbed fleet --kind; default mixed)")
    ap.add_argument("--memory", type=int, default=MEMORY_MIB, help="MiB per domain")
    ap.add_argument("--stock-profile", default="upstream",
                    help="the stock configurations' profile(s), comma-separated "
                    "(default upstream)")
    ap.add_argument("--summarize", action="store_true",
                    help="no runs: the table of the runs already in OUT (CONFIG-REPEAT/)")
    a = ap.parse_args()
    if a.summarize:
        print(table(collected(a.out)))
        return 0
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
                        a.count, a.only.split(",") if a.only else None,
                        tuple(a.stock_profile.split(","))):
                    d = a.out / f"{name.replace(':', '-').replace('@', '-')}-{r}"
                    d.mkdir(parents=True, exist_ok=True)
                    rep = one(d, name, sched, profile, qemu, a.count, a.fleet, a.memory)
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
