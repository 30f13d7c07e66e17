"""``livemig evacuate --connect SRC_URI --to DST_URI[,DST_URI...]``."""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from livemig.errors import SetupError, UsageError
from livemig.evacuate.pool import Pool
from livemig.settings import PROFILES, parse_sets
from livemig.units import parse_link_rate

# migrations at once at most: each costs a destination QEMU's start-up and its
# migration threads on both hosts. Measured on this 2-core TCG testbed (5 domains of
# 128 MiB, 100mbit links): all 5 at once emptied the host in 11.2 s, 2 at a time in
# 18-20 s, one at a time in 29-37 s: the fixed cost per migration overlaps well, so
# the cap is generous and the link's reserves decide (docs/results/evacuate-*.md)
DEFAULT_MAX_PARALLEL = 6
EXIT_CANCELLED = 3

_DOC = """Migrate every running domain (or --domains) off a libvirt host, through
`livemig migrate --domain` per VM (same engine, profile and verification), in an
order and with link shares planned from each VM's measured size, dirty rate and page
sample. --dry-run prints the plan and moves nothing. A failed VM stays on the source
and is retried once; Ctrl-C or --max-time aborts the running migrations (every
guest keeps running where it is). docs/evacuate.md."""


def register(sub: Any) -> None:
    e = sub.add_parser("evacuate", help="migrate every VM off a libvirt host, scheduled "
                       "against the link, verified", description=_DOC)
    e.add_argument("--connect", required=True, metavar="SRC_URI", help="the host to empty")
    e.add_argument("--to", required=True, metavar="DST_URI[,DST_URI...]",
                   help="destination hosts (VMs placed by free memory)")
    e.add_argument("--domains", help="only these running domains (comma-separated)")
    e.add_argument("--exclude", default="", help="leave these domains (comma-separated)")
    e.add_argument("--max-time", type=float, help="seconds for the whole evacuation")
    e.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    e.add_argument("--report", type=Path, metavar="DIR",
                   help="directory for the per-VM reports, evacuation.json and the chart "
                        "(default ./evacuation-<time>)")
    e.add_argument("--profile", default="livemig", choices=list(PROFILES),
                   help="settings preset for every migration (default livemig)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every migration (repeatable)")
    e.add_argument("--link", help="rate of the source's migration link (e.g. 1gbit); "
                   "default: the testbed's, when the hosts are the testbed's, else "
                   "read from this host's route to the destinations (the device's "
                   "speed or tbf/netem/htb rate, when the source's QEMUs run here)")
    e.add_argument("--links", choices=("auto", "shared", "separate"), default="auto",
                   help="shared: all destinations behind one link of --link; separate: "
                        "each destination its own path of --link; auto: separate on the "
                        "testbed (each destination host has its own link), else shared")
    e.add_argument("--max-parallel", type=int, default=DEFAULT_MAX_PARALLEL,
                   help=f"migrations at once at most (default {DEFAULT_MAX_PARALLEL})")
    e.add_argument("--scheduler", default="livemig", metavar="livemig|fixed:N",
                   help="livemig (planned order, concurrency and link shares; default) or "
                        "fixed:N, a baseline: N at a time, no caps (Nova's default is 1, "
                        "KubeVirt's 2 per node)")
    e.add_argument("--no-sample", action="store_true",
                   help="skip the page sample (assume nothing compresses)")
    e.add_argument("--unsafe", action="store_true",
                   help="passed to every migration: storage libvirt cannot tell is shared "
                        "(the testbed's shared directory)")
    e.add_argument("--no-doctor", action="store_true",
                   help="skip livemig doctor's check of each destination (with the "
                        "domains' emulators) before anything moves")
    e.add_argument("-q", "--quiet", action="store_true", help="no live view")
    e.set_defaults(func=cmd_evacuate)


def _names(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{option}: no domain named")
    return names


def _check(a: argparse.Namespace) -> list[str]:
    dsts = [u.strip() for u in a.to.split(",") if u.strip()]
    if not dsts:
        raise UsageError("--to: no destination URI")
    for u in [a.connect, *dsts]:
        if "://" not in u:
            raise UsageError(f"{u!r} is not a libvirt URI (e.g. qemu+tls://HOST/system)")
    if a.connect in dsts:
        raise UsageError("--to names the source host itself")
    if len(set(dsts)) != len(dsts):
        raise UsageError("--to names a destination twice")
    if a.max_time is not None and not (math.isfinite(a.max_time) and a.max_time > 0):
        raise UsageError("--max-time must be a positive number of seconds")
    if a.max_parallel < 1:
        raise UsageError("--max-parallel must be at least 1")
    if a.report is not None and a.report.exists() and not a.report.is_dir():
        raise UsageError(f"--report {a.report} is a file, not a directory")
    parse_sets(a.set)
    if a.scheduler != "livemig":
        kind, _, n = a.scheduler.partition(":")
        if kind != "fixed" or not n.isdigit() or int(n) < 1:
            raise UsageError(f"bad --scheduler {a.scheduler!r}: livemig or fixed:N (N >= 1)")
    if a.link is not None and parse_link_rate(a.link) is None:
        raise UsageError("--link none: the scheduler needs the link's rate")
    return dsts


def _link_bytes(a: argparse.Namespace, testbed: bool,
                read: Callable[[], tuple[float, str] | None] | None = None) -> float:
    """--link, else the testbed's, else the source host's route to the destinations
    (``read``)."""
    if a.link is not None:
        bits = parse_link_rate(a.link)
        assert bits is not None
        return bits / 8
    if testbed:
        from livemig.testbed import topology

        bits = topology.read_state().get("link_bits")
        if bits:
            return float(bits) / 8
    found = read() if read is not None else None
    if found is not None:
        if not a.quiet:
            print(f"livemig: the migration link, read from the source host: "
                  f"{found[0] * 8 / 1e6:.0f} Mbit/s ({found[1]})", file=sys.stderr, flush=True)
        return found[0]
    raise UsageError("--link RATE is needed (the source's migration link, e.g. 1gbit): "
                     "it could not be read from this host's route to the destinations")


def route_link(src: Any, names: list[str], dsts: list[str]) -> tuple[float, str] | None:
    """The slowest of the routes from the source's QEMUs (one of ``names``' processes,
    when they run on this host) to ``dsts``' hosts: their devices' speed or tbf/netem/htb rate
    (:mod:`livemig.engine.linkprobe`); None when any cannot be read."""
    from livemig.engine.linkprobe import peer_of, source_link
    from livemig.virt.sampling import local_pid

    pid = None
    for name in names:
        with contextlib.suppress(Exception):  # a domain gone, or not on this host
            pid = local_pid(src.lookupByName(name))
        if pid is not None:
            break
    if pid is None:
        return None
    found = []
    for u in dsts:
        peer = peer_of(u)
        link = source_link(pid, peer) if peer is not None else None
        if link is None:
            return None
        found.append((link.rate, f"{link.source} to {peer}"))
    return min(found)


def cmd_evacuate(a: argparse.Namespace) -> int:
    from livemig.evacuate import fleet, run
    from livemig.virt.conn import open_uri, testbed_side

    dsts = _check(a)
    only = _names(a.domains, "--domains")
    exclude = (_names(a.exclude, "--exclude") or []) if a.exclude else []
    testbed = all(testbed_side(u) is not None for u in [a.connect, *dsts])
    separate = a.links == "separate" or (a.links == "auto" and testbed)
    src = open_uri(a.connect, "the source")
    names = fleet.select(list(fleet.running_domains(src)), only, exclude)
    if not names:
        print("livemig: nothing to evacuate: no running domain selected on the source")
        return 0
    link = _link_bytes(a, testbed, lambda: route_link(src, names, dsts))
    fixed = run.fixed_concurrency(a.scheduler)
    pool = None
    if not a.dry_run:
        # the first wave's children warm while the destinations are checked (the
        # doctor's gate waits on libvirt and a probed QEMU, not on this host's CPU)
        pool = run.warm_pool(len(names), a.max_parallel, fixed)
        pool.fill(len(names))
    try:
        return _evacuate(a, src, names, dsts, link, separate, fixed, pool)
    finally:
        if pool is not None:
            pool.close()


def _evacuate(a: argparse.Namespace, src: Any, names: list[str], dsts: list[str],
              link: float, separate: bool, fixed: int | None, pool: Pool | None) -> int:
    from livemig.evacuate import fleet, report, run, schedule, view
    from livemig.virt.conn import open_uri

    t_doctor = time.monotonic()
    stock = {} if a.no_doctor else doctor_gate(src, names, a.connect, dsts)
    doctor_s = time.monotonic() - t_doctor
    free: dict[str, int] = {}
    for u in dsts:
        c = open_uri(u, "destination")
        try:
            free[u] = int(c.getFreeMemory())
        finally:
            c.close()
    if not a.quiet:
        print(f"livemig: measuring {len(names)} domains (dirty rate, page sample)",
              file=sys.stderr, flush=True)
    t_measure = time.monotonic()
    measured, spare = fleet.measure(src, names, do_sample=not a.no_sample)
    measure_s = time.monotonic() - t_measure
    links = {u: link for u in dsts} if separate else {schedule.SHARED_LINK: link}
    per_link = schedule.streams_per_link(spare) if fixed is None else None
    # a fixed-concurrency baseline places as before (wire bytes), not by livemig's plan
    where, nowhere = fleet.place([m.facts for m in measured], free, separate,
                                 links if fixed is None else None, a.max_parallel,
                                 per_link)
    facts = fleet.with_links([m.facts for m in measured], where, separate)
    plan = schedule.simulate(facts, links, a.max_parallel,
                             None if fixed is None else schedule.fixed(fixed),
                             per_link=per_link)
    print(_plan_text(plan, facts, where, nowhere, links, measured, spare, per_link))
    if a.dry_run:
        return 0
    out = a.report or Path(f"evacuation-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    samples = {m.facts.name: fleet.write_sample(out, m) for m in measured}
    vms = [run.Vm(f, where[f.name], sample_file=samples.get(f.name)) for f in sorted(
        facts, key=lambda f: plan.order().index(f.name))]
    opts = run.Options(src_uri=a.connect, profile=a.profile, out=out, links=links,
                       max_parallel=a.max_parallel, per_link=per_link,
                       max_time=a.max_time, sets=list(a.set),
                       quiet=a.quiet, unsafe=a.unsafe, scheduler=a.scheduler,
                       stock=stock)
    assert pool is not None  # made unless --dry-run
    evac = run.Evacuation(opts, vms, src, view.View(enabled=not a.quiet), pool)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda n, _f: evac.cancel(f"signal {signal.Signals(n).name}"))
    t0 = time.monotonic()
    evac.run()
    evac.view.show(evac, force=True)
    rep = report.build(evac, plan, {m.facts.name: m.detail() for m in measured}, nowhere,
                       time.monotonic() - t0)
    rep["measure_s"] = round(measure_s, 3)  # before the drain: not in time_to_empty_s
    rep["spare_cpus"] = None if spare is None else round(spare, 2)
    rep["streams_per_link"] = per_link
    rep["doctor_s"] = round(doctor_s, 3)  # likewise
    path = report.write(rep, out)
    chart = report.chart(rep, out)
    print(_summary(rep))
    print(f"report           {path}" + (f"\nchart            {chart}" if chart else ""))
    if rep["outcome"] == "emptied":
        return 0
    return EXIT_CANCELLED if evac.cancelled else 1


def doctor_gate(src: Any, names: list[str], src_uri: str, dsts: list[str]
                ) -> dict[str, str]:
    """``livemig doctor`` on every destination with each emulator the domains name
    (a destination must have it): the first finding that keeps one out is a one-line
    error before anything is measured or moved (docs/install.md). Returns the
    destinations whose every probed emulator is a stock QEMU (how the probe showed
    it): their migrations start as toward a stock QEMU, without the first attempt a
    patched source's refused mechanisms would cost each VM (1.3-5.5 s measured)."""
    from livemig.doctor.gate import examine
    from livemig.tls.creds import libvirt_one_host
    from livemig.virt.facts import emulator

    named = sorted({e for n in names if (e := emulator(src.lookupByName(n).XMLDesc(0)))})
    emulators: list[str | None] = [*named] or [None]
    stock: dict[str, str] = {}
    for u in dsts:
        hows: list[str | None] = []
        for e in emulators:
            verdict = examine(u, Path(e) if e else None,
                              tls_required=not libvirt_one_host(src_uri, u))
            if verdict.fails:
                f = verdict.fails[0]
                raise SetupError(f"{u} cannot take part: {f.what}: {f.detail} "
                                 f"(livemig doctor {u}; or --no-doctor)")
            hows.append(verdict.stock)
        if all(hows):
            stock[u] = "; ".join(h for h in hows if h)
    return stock


def _host(uri: str) -> str:
    return urlsplit(uri).hostname or uri


def _plan_text(plan: Any, facts: list[Any], where: dict[str, str], nowhere: list[str],
               links: dict[str, float], measured: list[Any], spare: float | None = None,
               per_link: int | None = None) -> str:
    from livemig.evacuate import schedule

    by = {f.name: f for f in facts}
    how = {m.facts.name: m for m in measured}
    lines = [f"plan: {len(plan.vms)} VMs, up to {plan.max_parallel()} at once, links "
             + ", ".join(f"{_host(k) if '://' in k else k} {v * 8 / 1e6:.0f} Mbit/s"
                         for k, v in links.items())
             + ("" if spare is None else f"; source host {spare:.1f} CPUs idle")
             + ("" if per_link is None else f": {per_link} stream per link at a time")]
    lines.append(f"  {'#':>2} {'domain':<14} {'to':<12} {'RAM':>7} {'dirty':>10} "
                 f"{'ratio':>5} {'start':>6} {'end':>6} {'cap MiB/s':>9}  kind")
    for k, p in enumerate(plan.vms, 1):
        f = by[p.name]
        link = links[f.link]
        kind = ("heavy: alone" if schedule.heavy(f, link)
                else "busy" if f.dirty_rate > 0.1 * link else "light")
        lines.append(f"  {k:>2} {p.name:<14} {_host(where[p.name]):<12} "
                     f"{f.ram >> 20:>5}Mi {f.dirty_rate / 2**20:>6.1f}Mi/s {f.ratio:>5.2f} "
                     f"{p.start:>6.1f} {p.end:>6.1f} {_cap(p.bandwidths[0], link):>9}  {kind}"
                     + (f" ({how[p.name].note})" if how[p.name].note else ""))
    for n in nowhere:
        lines.append(f"   - {n:<14} stays: no destination has the memory")
    lines.append(f"expected time to empty the host: {plan.total_s:.1f} s")
    return "\n".join(lines)


def _cap(cap: float, link: float) -> str:
    """The plan's cap column: none when it is not below the link (TCP shares it)."""
    return "none" if cap >= link else f"{cap / 2**20:.0f}"


def _summary(rep: dict[str, Any]) -> str:
    t = rep["time_to_empty_s"]
    lines = [f"evacuation       {rep['outcome']}" + (f" ({rep['reason']})" if rep["reason"]
                                                    else ""),
             f"time to empty    {'-' if t is None else f'{t:.1f} s'} (planned "
             f"{rep['expected_s']:.1f} s)",
             f"migrated         {rep['migrated']} of {len(rep['vms'])}, verified "
             f"{rep['verified']}",
             f"bytes            {rep['bytes'] / 2**20:.1f} MiB",
             f"longest pause    {rep['longest_pause_ms'] or '-'} ms"]
    if rep["failures"]:
        lines.append(f"failed           {', '.join(rep['failures'])}")
    if rep["left_on_source"]:
        lines.append(f"on the source    {', '.join(rep['left_on_source'])}")
    return "\n".join(lines)
