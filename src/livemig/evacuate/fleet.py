"""The source host's fleet, measured before the plan, and where each VM goes.

Per running domain: its memory (``virDomainGetInfo``), its dirty rate, and a page
sample (the same samplers as the engine's encoding choice,
:func:`livemig.engine.adapt.sampler_for`: the patched QEMU's own, else the QEMU's
own mapping through ``/proc`` when it runs on this kernel, else libvirt's memory
peek) for how much of its RAM is non-zero and how well its pages and their
rewrites compress. The dirty rate is the sample's (its kept pages rewritten between
its looks) unless QEMU's ``calc-dirty-rate`` (libvirt's
``virDomainStartDirtyRateCalc``, page-sampling mode, all domains at once over one
``DIRTY_CALC_S``) reads significantly more: :func:`dirty_rate`. QEMU's page sampling
looks at few pages of a small guest and errs both ways (64 pages on 128 MiB: 31-43
MiB/s read for a 12 MB/s writer); its dirty-bitmap mode (distinct pages, exact in
principle) read 0 for every writer under TCG on this testbed, so it is not used.
Placement: see
:func:`place` (``virNodeGetFreeMemory`` less what is already placed there); a VM
that fits nowhere stays and is reported.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from livemig.errors import LivemigError, UsageError
from livemig.evacuate import schedule
from livemig.evacuate.schedule import SHARED_LINK, VmFacts
from livemig.idlecpu import IdleMeter
from livemig.policy.encoding import MIN_SAMPLES, Sample
from livemig.sampling import given
from livemig.sampling.base import SampleResult

DIRTY_CALC_S = 1  # seconds QEMU samples the dirty rate over (libvirt's unit: whole s)
DIRTY_WAIT_S = 5.0  # at most this long past DIRTY_CALC_S for the results
CPU_WINDOW_S = 0.5  # seconds the domains' CPU use is read over (schedule.streams_per_link)
# destination memory kept free beyond the guests' RAM: QEMU's own (~100 MiB under
# TCG with its translation cache) and the host's
DST_MARGIN = 256 << 20
DEFAULT_RATIO = 1.0  # compressibility assumed when no sample could be taken
# pages per GiB QEMU's calc-dirty-rate samples when not told (libvirt does not tell it)
QEMU_PAGES_PER_GIB = 512
# how far above the page sample's rate QEMU's window must read to be taken instead
# (standard deviations of its changed-page count): about one chance in forty by noise
WINDOW_SIGMAS = 2.0
# fleets up to this size are placed by the plan's model (one simulation per VM and
# destination, each O(n²): 4.6 s for 40 VMs on two destinations on this loaded
# 2-core host); larger ones by wire bytes
MODEL_PLACE_MAX = 32


@dataclass(frozen=True)
class Measured:
    facts: VmFacts
    vcpus: int
    sampler: str | None  # which sampler, None: not sampled
    note: str = ""  # why not sampled, or what failed
    sampled: SampleResult | None = None  # handed to the VM's migration (sampling.given)
    sampled_at: float = 0.0  # when (seconds since the epoch)
    # the dirty rates measured (bytes/s, None: not measured)
    window_rate: float | None = None
    sample_rate: float | None = None

    @property
    def dirty_from(self) -> str:
        """Which rate the plan took (:func:`dirty_rate`)."""
        return dirty_rate(self.window_rate, self.sample_rate)[1]

    def detail(self) -> dict[str, Any]:
        """The report's measurement entry."""
        def mib(x: float | None) -> float | None:
            return None if x is None else round(x / 2**20, 2)
        return {"sampler": self.sampler, "note": self.note,
                "dirty_mib_s": {"window": mib(self.window_rate),
                                "sample": mib(self.sample_rate), "taken": self.dirty_from}}


def select(names: list[str], only: list[str] | None, exclude: list[str]) -> list[str]:
    """``--domains`` (each must be running on the source) minus ``--exclude``."""
    if only is not None:
        missing = [n for n in only if n not in names]
        if missing:
            raise UsageError(f"--domains: {', '.join(missing)} not running on the source")
        names = [n for n in names if n in only]
    return [n for n in names if n not in exclude]


def running_domains(conn: Any) -> dict[str, Any]:
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    doms = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
    return {d.name(): d for d in sorted(doms, key=lambda d: str(d.name()))}


def spare_cpus(conn: Any, seconds: float) -> float | None:
    """The source host's idle CPUs over ``seconds`` (``virNodeGetCPUStats``, as the
    encoding model reads them: :func:`livemig.virt.sampling.node_counters`); a daemon that
    will not say: its CPUs (``virNodeGetInfo``) less what its running domains used
    (their ``cpu.time``, every QEMU thread). Taken before the samples, whose threads
    would count; None when libvirt cannot say either."""
    from livemig.virt.sampling import node_counters

    # a meter without a first reading answers None at once, without the wait
    idle = asyncio.run(IdleMeter(node_counters(conn), seconds).idle_cpus())
    return idle if idle is not None else _domains_spare(conn, seconds)


def _domains_spare(conn: Any, seconds: float) -> float | None:
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()

    def used(doms: list[Any]) -> tuple[float, int]:
        stats = conn.domainListGetStats(doms, libvirt.VIR_DOMAIN_STATS_CPU_TOTAL)
        return time.monotonic(), sum(int(s.get("cpu.time", 0)) for _, s in stats)
    try:
        doms = list(running_domains(conn).values())
        t0, c0 = used(doms)
        time.sleep(seconds)
        t1, c1 = used(doms)
        cpus = float(conn.getInfo()[2])
    except Exception:  # an old daemon, a domain gone meanwhile: unknown
        return None
    return max(0.0, cpus - (c1 - c0) / 1e9 / max(t1 - t0, 1e-3))


def dirty_rates(conn: Any, doms: list[Any]) -> dict[str, float]:
    """Bytes/s each domain dirties, measured at once over ``DIRTY_CALC_S``."""
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    started = []
    for d in doms:
        for mode in (libvirt.VIR_DOMAIN_DIRTYRATE_MODE_PAGE_SAMPLING, 0):
            try:
                d.startDirtyRateCalc(DIRTY_CALC_S, mode)
                started.append(d)
                break
            except libvirt.libvirtError:
                continue
    out: dict[str, float] = {}
    deadline = time.monotonic() + DIRTY_CALC_S + DIRTY_WAIT_S
    time.sleep(DIRTY_CALC_S)
    while started and time.monotonic() < deadline:
        for dom, stats in conn.domainListGetStats(started, libvirt.VIR_DOMAIN_STATS_DIRTYRATE):
            if stats.get("dirtyrate.calc_status") == 2:  # VIR_DOMAIN_DIRTYRATE_MEASURED
                out[dom.name()] = float(stats.get("dirtyrate.megabytes_per_second", 0)) * 2**20
        started = [d for d in started if d.name() not in out]
        if started:
            time.sleep(0.2)
    return out


def sample(conn: Any, dom: Any) -> tuple[SampleResult | None, str]:
    """A page sample of ``dom`` (None and why when none could be taken)."""
    from livemig.engine.adapt import sampler_for
    from livemig.virt.sampling import DomainEnd, host_hints

    end = DomainEnd(dom)

    async def go() -> tuple[SampleResult, str]:
        cmds = {c["name"] for c in await end.cmd("query-commands")}
        sampler, close = sampler_for(end, "auto", cmds, host_hints(conn, dom))
        try:
            return await sampler.sample(), sampler.name
        finally:
            close()
    try:
        s, name = asyncio.run(go())
        return s, name
    except LivemigError as e:
        return None, str(e)


def facts_from(name: str, ram: int, window: float | None, s: Sample | None) -> VmFacts:
    """The scheduler's facts from a measurement; without a sample, every byte counts
    and nothing compresses (the cautious guess). The dirty rate: :func:`dirty_rate`
    of QEMU's ``calc-dirty-rate`` window (``window``, None: not measured) and the
    sample's."""
    rate, _ = dirty_rate(window, sample_rate(ram, s))
    if s is None:
        return VmFacts(name, ram, float(ram), rate, DEFAULT_RATIO, DEFAULT_RATIO)
    ratio = _best(s.first) or DEFAULT_RATIO
    # a re-sent page goes as a delta or whole, whichever packs it better: a whole-page
    # writer's deltas pack 1.6x where zstd packs its pages 2.2x (the busy fleet)
    resend = max(_best(s.delta) or 0.0, _best(s.resend) or 0.0) or ratio
    return VmFacts(name, ram, ram * s.nonzero_share, rate, ratio, resend)


def sample_rate(ram: int, s: Sample | None) -> float | None:
    """Bytes/s the page sample saw rewritten (its kept pages rewritten between its two
    looks, as the encoding model reads it); None without a sample of at least
    ``MIN_SAMPLES`` kept pages."""
    if s is None or s.kept < MIN_SAMPLES or s.interval <= 0:
        return None
    return ram * s.nonzero_share * min(1.0, s.rewritten / s.kept) / s.interval


def dirty_rate(window: float | None, sampled: float | None) -> tuple[float, str]:
    """The dirty rate the plan takes (bytes/s) and whose it is: ``sample``, ``window``
    or ``none`` (0: neither was measured).

    The page sample looks at thousands of pages twice; QEMU's ``calc-dirty-rate``, as
    libvirt starts it (no page count: QEMU's default ``QEMU_PAGES_PER_GIB``), at about
    a hundred on a 192 MiB guest, where one changed page reads 2 MiB/s. So the sample's
    rate stands unless the window reads significantly more: a changed-page count more
    than ``WINDOW_SIGMAS`` standard deviations (Poisson) above what the sample's rate
    gives in the window, which a guest that got busier would show. Taking the larger
    of the two, as before, took the window's noise: on the busy fleet it read 18-20
    MiB/s for a whole-page writer of 16 MiB/s that the sample put at 11-14 MiB/s (set
    h of docs/results/evacuate-2026-11-28.md), which made it heavy and sent three small
    writers to one link (20.5-20.8 s to empty, against 18.5 s where it was not). A rate
    read too low is caught while the VM migrates (the drain re-plans a VM busier than
    measured); one read too high only costs the plan."""
    if sampled is None:
        return (window, "window") if window is not None else (0.0, "none")
    if window is None or window <= sampled:
        return sampled, "sample"
    unit = (1 << 30) / QEMU_PAGES_PER_GIB / DIRTY_CALC_S  # bytes/s one changed page reads
    seen, expected = window / unit, sampled / unit
    if seen > expected + WINDOW_SIGMAS * math.sqrt(max(expected, 1.0)):
        return window, "window"
    return sampled, "sample"


def _best(codecs: dict[str, Any]) -> float | None:
    return max((c.ratio for c in codecs.values()), default=None)


def measure(conn: Any, names: list[str], do_sample: bool = True
            ) -> tuple[list[Measured], float | None]:
    """Every domain's facts. The dirty rates (QEMU's ``DIRTY_CALC_S`` window, all
    domains at once) and the page samples (each in its QEMU, ~0.5-0.7 s) are taken
    side by side, as many samples at once as the source host has CPUs (each costs
    ~0.2 s of CPU that its guests and the others' share): one domain after the
    other, five took 3.5-3.7 s before the drain could start, and a fleet of a
    hundred would wait a minute; all five at once took 1.0-1.5 s but slowed every
    guest of this 2-core host by about a third meanwhile
    (docs/results/evacuate-2026-11-28.md). A sample's codec timings are its
    thread's CPU time, so sharing the CPUs does not skew them. Before them, the host's
    idle CPUs over ``CPU_WINDOW_S`` (:func:`spare_cpus`; the samples' own CPU would
    count as the guests'), returned beside the facts."""
    spare = spare_cpus(conn, CPU_WINDOW_S)
    doms = running_domains(conn)
    chosen = [doms[n] for n in names]

    def sampled(d: Any) -> tuple[SampleResult | None, str, float]:
        s, how = sample(conn, d) if do_sample else (None, "not sampled (--no-sample)")
        return s, how, time.time()
    # the dirty-rate window first (one worker, mostly waiting), then the samples
    with ThreadPoolExecutor(max_workers=host_cpus(conn) + 1) as pool:
        rates_f = pool.submit(dirty_rates, conn, chosen)
        samples_f = [pool.submit(sampled, d) for d in chosen]
        rates = rates_f.result()
        samples = [f.result() for f in samples_f]
    out = []
    for d, (s, how, at) in zip(chosen, samples, strict=True):
        info = d.info()
        ram = int(info[1]) * 1024
        window, seen = rates.get(d.name()), sample_rate(ram, s.sample if s else None)
        note = ("dirty rate not measured: assumed 0" if window is None and seen is None
                else "")
        out.append(Measured(facts_from(d.name(), ram, window, s.sample if s else None),
                            int(info[3]), how if s is not None else None,
                            "; ".join(x for x in (note, "" if s else how) if x),
                            s, at, window, seen))
    return out, spare


def host_cpus(conn: Any) -> int:
    """The source host's CPUs (``virNodeGetInfo``), 1 when it cannot be told."""
    try:
        return max(1, int(conn.getInfo()[2]))
    except Exception:  # an old daemon, a test's connection: one at a time
        return 1


def write_sample(out: Path, m: Measured) -> Path | None:
    """``out/NAME.sample.json``: the VM's page sample for its migration to reuse
    (:mod:`livemig.sampling.given`); None when it was not sampled."""
    if m.sampled is None:
        return None
    path = out / f"{m.facts.name}.sample.json"
    given.dump(path, m.facts.name, m.sampled, m.sampled_at)
    return path


def place(fleet: list[VmFacts], free: dict[str, int], separate_links: bool,
          links: dict[str, float] | None = None, max_parallel: int = 3,
          per_link: int | None = None) -> tuple[dict[str, str], list[str]]:
    """Destination per VM and the VMs that fit nowhere.

    On one shared link: largest VM first, onto the destination with the most free
    memory left. With ``separate_links`` (each destination its own path) and the
    links' rates: the VMs longest first (their modelled time alone on a link, the
    longest-processing-time rule for the shortest makespan), each onto the
    destination with room where the plan of the VMs placed so far ends soonest
    (:func:`schedule.simulate` with the scheduler's own rule: a heavy VM runs alone
    on its link, so what else goes there waits for it, and light ones overlap their
    fixed costs), then the fewest wire bytes placed, then the most free memory left.
    Balancing bytes alone put the busy fleet's heavy VM behind two others on one
    link while the other link emptied 7 s earlier (the model: 34 s against 27 s for
    the best split; docs/results/evacuate-2026-11-27.md). Fleets larger than
    ``MODEL_PLACE_MAX`` are balanced on wire bytes (the plan is simulated once per
    VM and destination)."""
    left = dict(free)
    load = {u: 0.0 for u in free}
    where: dict[str, str] = {}
    nowhere: list[str] = []
    model = separate_links and links is not None and len(fleet) <= MODEL_PLACE_MAX
    if model:
        assert links is not None
        fastest = max(links.values())
        order = sorted(fleet, key=lambda f: (-schedule.seconds(f, fastest), f.name))
    else:
        order = sorted(fleet, key=lambda f: (-f.ram, -f.nonzero, f.name))
    placed: list[VmFacts] = []
    for f in order:
        room = [u for u in left if left[u] >= f.ram + DST_MARGIN]
        if not room:
            nowhere.append(f.name)
            continue

        def ends(u: str, f: VmFacts = f) -> float:
            if not model:
                return 0.0
            assert links is not None
            trial = [*placed, replace(f, link=u)]
            return round(schedule.simulate(trial, links, max_parallel,
                                           per_link=per_link).total_s, 3)

        dst = min(room, key=lambda u: (ends(u), load[u] if separate_links else 0.0,
                                       -left[u], list(free).index(u)))
        where[f.name] = dst
        placed.append(replace(f, link=dst))
        left[dst] -= f.ram + DST_MARGIN
        load[dst] += f.nonzero / f.ratio
    return where, nowhere


def with_links(fleet: list[VmFacts], where: dict[str, str], separate: bool) -> list[VmFacts]:
    return [replace(f, link=where[f.name] if separate else SHARED_LINK)
            for f in fleet if f.name in where]
