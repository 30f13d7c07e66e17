"""The second plan: the first plan adapted to the QEMU at hand and to the guest.

Runs once, after the source's QMP is reachable and before any migration setting is
changed. It produces an explicit second, frozen :class:`Plan` (the first one is not
edited) plus what it decided and why, for the report:

- ``encoding=auto``: a sample of the guest's pages through the best sampler the source
  offers (:func:`sampler_for`), weighed by :mod:`livemig.policy.encoding` against the
  link, the CPUs left beside the vCPUs, the source host's idle CPUs and the codecs
  this QEMU's multifd has;
- with ``x-multifd-compression-switch`` on both ends (the patched build: qemu/patches/
  0012, 0013) the sample does not hold the migration back: the second plan starts with
  zstd keeping lz4's delta cache (``encoding.start_choice``) and the capability, and
  :attr:`Adapted.deferred` takes the sample and makes the choice while the first pass
  runs (the engine switches the stream to it: :mod:`livemig.engine.switch`);
- the throttle: the profile's own throttles (``converge``, ``reference``, ...) need the
  patched QEMU's ``set-cpu-throttle``; on a QEMU without it the profile falls back to
  what the stock profiles use (QEMU's auto-converge, stock increments), so livemig
  never throttles harder than stock there, and the encoding is weighed under that
  ladder (:mod:`livemig.policy.autoconverge`).

Settings given with ``--set`` are never changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.engine.endpoint import QmpEnd
from livemig.engine.events import EventStream
from livemig.engine.linkprobe import peer_of, source_link
from livemig.engine.plan import Plan
from livemig.errors import LivemigError, UsageError, VMError
from livemig.idlecpu import SHORT_WINDOW_S, IdleMeter
from livemig.policy import encoding
from livemig.sampling.base import Sampler
from livemig.sampling.peek import PeekSampler, Read
from livemig.sampling.qemu import START as QEMU_SAMPLE
from livemig.sampling.qemu import QemuSampler
from livemig.sampling.readers import (
    PmemsaveReader,
    ProcMemReader,
    XpReader,
    hmp_over,
    qemu_is_local,
)
from livemig.settings import SWITCH_CAP
from livemig.units import parse_link_rate

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

THROTTLE_COMMAND = "set-cpu-throttle"  # patched QEMU (qemu/patches/0001)
POLICY_THROTTLES = ("reference", "direct", "staged", "converge")
STOCK_THROTTLE = "auto-converge"
# multifd-compression values the model knows, by QEMU's name
_CODEC_NAMES = {"zstd": "zstd", "lz4": "lz4", "none": "plain"}
# what a stock QEMU's multifd has of those (zstd where it was built with it, as
# Debian's and this project's unpatched build are)
STOCK_CODECS = frozenset({"zstd", "plain"})
# what a switch may change, set at the start too (the stream starts with
# encoding.start_choice): the run puts back what it set, and a choice without them
# has them so (no delta encoding, zstd's level 1)
START_EXTRA = {encoding.DELTA_KEY: "0", "multifd-zstd-level": "1"}


@dataclass(frozen=True)
class Hints:
    """What the caller knows that QEMU does not."""

    link_rate: float | None = None  # bytes/s of the migration link; None: unknown
    # the destination host (its address or name), when the plan's URI does not say it
    # (libvirt chooses the URI): where the source host's route to it is read from
    peer: str | None = None
    cpus: float | None = None  # host CPUs for the migration threads; None: this host's
    host_available: int | None = None  # bytes free on the source host; None: this host's
    file_sampler: Sampler | None = None  # the lab's RAM-file reader (sampler=file)
    scratch: Path | None = None  # where pmemsave may write (a private dir is made in it)
    peek: Read | None = None  # a reader of guest-physical memory (libvirt's memory peek)
    # finds the source QEMU's process on this host when the end does not know it (a
    # libvirt domain's): asked only when a sample would read its RAM through /proc, or
    # the link's rate is read from its network namespace
    local_pid: Callable[[], int | None] | None = None
    tls: bool | None = None  # the stream is encrypted (None: as the plan says)
    given: Sampler | None = None  # a sample taken before (livemig evacuate's): sampler=auto
    # the destination's QEMU can load a stream whose codec changes (SWITCH_CAP): the
    # caller read it; None or False: the choice is made before the migration starts
    dst_switch: bool | None = None
    # the destination QEMU's multifd codecs and whether it has the delta cache
    # (encoding.DELTA_KEY), when its build differs from the source's (None: as the
    # source's): a codec is chosen only if both ends have it
    dst_codecs: frozenset[str] | None = None
    dst_delta: bool | None = None
    # the source host's idle CPUs, a meter the caller started early (None: not known,
    # and the model spends no CPU it cannot see: encoding.idle_covers)
    idle: IdleMeter | None = None
    # the destination QEMU runs on this host (its receive work shares the idle CPUs a
    # codec level above the default needs: encoding.level_cpu)
    dst_local: bool = False
    # the source QEMU's own max-bandwidth caps the stream when --bandwidth is not given
    # (attach and the lab: livemig calls migrate and leaves it as it is, QEMU's
    # default 128 MiB/s if nobody set it); False under libvirt, which sets its own
    # (unlimited unless a bandwidth is given)
    qemu_cap: bool = True


# takes the sample and chooses (telling the run's event stream): the report's `encoding`
# and the settings to switch to
Deferred = Callable[[EventStream], Awaitable[tuple[dict[str, Any], dict[str, str]]]]


@dataclass(frozen=True)
class Adapted:
    plan: Plan  # the second plan
    encoding: dict[str, Any] | None  # the report's `encoding`
    notes: tuple[dict[str, Any], ...] = ()  # what else was adapted, and why
    # the choice made while the migration runs (SWITCH_CAP on both ends); None: made
    deferred: Deferred | None = None


async def adapt(src: QmpEnd, plan: Plan, hints: Hints, events: EventStream) -> Adapted:
    commands = {c["name"] for c in await src.cmd("query-commands")}
    extra: dict[str, str] = {}
    notes: list[dict[str, Any]] = []
    throttle = plan.livemig_setting("throttle")
    if throttle in POLICY_THROTTLES and THROTTLE_COMMAND not in commands \
            and "throttle" not in plan.explicit:
        extra["throttle"] = STOCK_THROTTLE
        notes.append({"setting": "throttle", "from": throttle, "to": STOCK_THROTTLE,
                      "why": f"this QEMU has no {THROTTLE_COMMAND} (unpatched): QEMU's "
                             "auto-converge, as the stock profiles use"})
        if plan.livemig_settings()["downtime-ramp"] and "downtime-ramp" not in plan.explicit:
            # the ramp raises the limit for the rounds the converge throttle plans; under
            # auto-converge's ladder it only lengthened the pause (busy-db via attach:
            # downtime 131-267 ms vs stock's 3-10 ms, same time; docs/results)
            extra["downtime-ramp"] = "off"
            notes.append({"setting": "downtime-ramp", "from": "on", "to": "off",
                          "why": "it plans with the converge throttle, which this QEMU "
                                 "lacks: stock's fixed downtime limit instead"})
    auto_converge = extra.get("throttle", throttle) == STOCK_THROTTLE
    deferred: Deferred | None = None
    if await _can_defer(src, plan, hints, commands):
        # the delta cache's size needs the guest's RAM and the host's free memory
        # (~0.05 s of queries before `migrate`); the choice reuses what they read,
        # the idle CPUs over the checks too (the short window: the start is zstd
        # whatever they show, and a reading during the migration would count its
        # own threads as the host's load)
        known = await context(src, plan, hints, switch=True,  # _can_defer read it
                              idle_window=SHORT_WINDOW_S)

        async def choose(ev: EventStream) -> tuple[dict[str, Any], dict[str, str]]:
            rec, applied = await _encoding(src, plan, hints, commands, ev, auto_converge,
                                           known)
            return rec or {}, applied
        deferred = choose
        begin = encoding.start_choice(known)
        start = {k: v for k, v in {**START_EXTRA, **begin.applied(), SWITCH_CAP: "on"}.items()
                 if k not in plan.explicit}
        first: dict[str, Any] = {
            "encoding": begin.encoding, "deferred": True, "started_with": begin.encoding,
            "reason": f"the sample runs beside the first pass ({SWITCH_CAP} on both "
                      f"ends): {begin.encoding} {begin.reason}", "applied": start}
        extra.update(start)
        events.event("encoding deferred", **first)
        enc: dict[str, Any] | None = first
    else:
        enc, settings = await _encoding(src, plan, hints, commands, events, auto_converge)
        extra.update(settings)
    for n in notes:
        events.event("adapted", **n)
    second = dataclasses.replace(plan, settings=tuple({**plan.wanted, **extra}.items()))
    return Adapted(second.validate(), enc, tuple(notes), deferred)


async def _can_defer(src: QmpEnd, plan: Plan, hints: Hints, commands: set[str]) -> bool:
    """The choice can wait for the migration to run: ``encoding=auto`` with nothing of
    the encoding given, QEMU's own sampler, and both ends able to switch codecs."""
    if not hints.dst_switch or plan.livemig_setting("encoding") != "auto" \
            or plan.explicit & (encoding.KEYS | {SWITCH_CAP}) \
            or plan.livemig_setting("sampler") not in ("auto", "qemu") \
            or hints.given is not None or QEMU_SAMPLE not in commands:
        return False
    return await _has_switch(src)


async def _encoding(src: QmpEnd, plan: Plan, hints: Hints, commands: set[str],
                    events: EventStream, auto_converge: bool = False,
                    known: encoding.Context | None = None
                    ) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The encoding (the report's record, the settings it applies); ``known``: the
    context already read (the deferred choice's), else it is read while the sampler
    waits."""
    want = plan.livemig_setting("encoding")
    if want == "off":
        return None, {}
    given = sorted(plan.explicit & encoding.KEYS)
    if given:
        events.event("encoding not chosen", reason=f"set explicitly: {', '.join(given)}")
        return {"encoding": None, "reason": f"set explicitly: {', '.join(given)}"}, {}
    sampled: dict[str, Any] | None = None
    if want == "auto":
        sampler, close = sampler_for(src, plan.livemig_setting("sampler"), commands, hints,
                                     before_migrate=known is None)
        events.say(f"sampling the guest's pages ({sampler.name} sampler)")
        # the context's queries (query-qmp-schema: ~0.05 s) while the sample reads
        # through /proc/PID/mem, or, when its reads go through the same monitor, while
        # it waits for its next look: the user waits for both before the migration starts
        queried = asyncio.Event()
        beside_reads = isinstance(sampler, PeekSampler) and not sampler.monitor_reads

        async def read_context() -> encoding.Context:
            try:
                ctx = known
                if ctx is None:
                    if not beside_reads:
                        await sampler.waiting.wait()
                    ctx = await context(src, plan, hints, queried=queried)
                return dataclasses.replace(ctx, auto_converge=auto_converge)
            finally:
                queried.set()  # a failed or known context leaves nothing to wait for

        reading = asyncio.ensure_future(read_context())
        if isinstance(sampler, PeekSampler):
            async def settled(partial: encoding.Sample) -> bool:
                return encoding.decided_at_half_way(partial, await asyncio.shield(reading))
            # a guest that hardly rewrites, or rewrites whole pages, is decided by its
            # half-way look
            sampler.settled = settled
            sampler.quiet = queried.wait  # QEMU's short window waits for these queries
        try:
            try:
                result = await sampler.sample()
            finally:
                close()
                sampler.waiting.set()
        except BaseException as e:
            reading.cancel()
            await asyncio.wait({reading})
            if isinstance(e, LivemigError):
                raise VMError(f"page sample ({sampler.name}): {e}") from e
            raise
        ctx = await reading
        sampled = result.as_dict()
        choice = encoding.choose_sample(result.sample, ctx)
    elif want in encoding.ENCODINGS:
        ctx = dataclasses.replace(await context(src, plan, hints), auto_converge=auto_converge)
        choice = encoding.Choice(want, "set explicitly")
    else:  # plan validation refuses this already
        raise UsageError(f"bad --set encoding={want}")
    applied = {k: v for k, v in choice.applied().items() if k not in plan.explicit}
    if "lz4" in applied.values() and "lz4" not in ctx.codecs and not ctx.delta:
        raise UsageError(f"encoding={choice.encoding}: this QEMU's multifd has no lz4 "
                         "(the patched build has it)")
    rec = {"encoding": choice.encoding, "reason": choice.reason,
           "changed_share": choice.changed_share, "zlib_ratio": choice.ratio,
           "samples": choice.samples, "applied": applied, "sampler": sampled,
           "context": {"link_rate": ctx.link_rate, "link_from": ctx.link_from,
                       "cpus": ctx.cpus,
                       "idle_cpus": ctx.idle_cpus,
                       "guest_ram": ctx.guest_ram, "codecs": sorted(ctx.codecs),
                       "delta": ctx.delta, "switch": ctx.switch,
                       "dst_local": ctx.dst_local,
                       "auto_converge": ctx.auto_converge},
           "page_rates": {k: round(v) for k, v in choice.page_rates.items()}}
    then = choice.after_first_pass()
    if then:
        rec["after_first_pass"] = then
    events.event("encoding chosen", **rec)
    events.say(f"stream encoding {choice.encoding}: {choice.reason}")
    return rec, applied


def sampler_for(src: QmpEnd, mode: str, commands: set[str],
                hints: Hints, before_migrate: bool = False) -> tuple[Sampler, Any]:
    """The sampler for ``mode`` (``auto``: a sample the caller was given, else the
    patched QEMU's own, else ``/proc/PID/mem`` for a QEMU on this host livemig may
    trace, else libvirt's memory peek for a domain, else ``pmemsave`` for a QEMU on
    this host, else HMP ``xp``) and a function that cleans up after it.

    ``before_migrate``: the user waits for the sample (no codec switch at the
    destination: a stock one). Then a patched QEMU on this host is read through
    ``/proc/PID/mem`` first: that reader decides most guests at its half-way look
    (0.29 s on the whole-page guest), QEMU's own takes its two looks 0.45 s apart
    (0.54 s; docs/results/mixed-builds-2026-11-30)."""
    if mode == "file":
        if hints.file_sampler is None:
            raise UsageError("--set sampler=file needs a guest RAM file (lab runs only)")
        return hints.file_sampler, lambda: None
    if mode == "auto" and hints.given is not None:
        return hints.given, lambda: None
    own = QEMU_SAMPLE in commands
    quick = mode == "auto" and before_migrate and qemu_is_local(src.pid)
    if own and (mode == "qemu" or (mode == "auto" and not quick)):
        return QemuSampler(src.cmd), lambda: None
    if mode == "qemu":
        raise UsageError(f"--set sampler=qemu: this QEMU has no {QEMU_SAMPLE} (the "
                         "patched build has it)")
    hmp = hmp_over(src.cmd)
    local = src.pid if qemu_is_local(src.pid) else None
    if local is None and mode in ("auto", "procmem") and hints.local_pid is not None:
        local = hints.local_pid()
    if mode in ("auto", "procmem") and local is not None:
        # pmemsave for the reads outside the RAM ranges: a QEMU the end names (a
        # domain's writes files as its own user, which libvirt's confinement may refuse)
        fallback: PmemsaveReader | None = (PmemsaveReader(src.cmd, local, hints.scratch)
                                           if src.pid is not None else None)
        try:
            mem = ProcMemReader(hmp, local, fallback or (hints.peek or XpReader(hmp)))
        except OSError as e:
            if fallback is not None:
                fallback.close()
            if mode == "procmem":
                raise UsageError(f"--set sampler=procmem: cannot read /proc/{local}/mem "
                                 f"({e.strerror})") from e
        else:
            def close() -> None:
                mem.close()
                if fallback is not None:
                    fallback.close()
            return PeekSampler("procmem", hmp, mem, qmp=src.cmd, prepare=mem.prepare,
                               notes=lambda: {"fallback_reads": mem.fallbacks},
                               monitor_reads=False), close
    if mode == "procmem":
        raise UsageError("--set sampler=procmem: the source QEMU does not run on this host")
    if own and mode == "auto":  # QEMU's mapping could not be read: its own sampler
        return QemuSampler(src.cmd), lambda: None
    if mode in ("auto", "peek") and hints.peek is not None:
        return PeekSampler("libvirt-peek", hmp, hints.peek, qmp=src.cmd), lambda: None
    if mode in ("auto", "pmemsave") and qemu_is_local(src.pid):
        assert src.pid is not None
        reader = PmemsaveReader(src.cmd, src.pid, hints.scratch)
        return PeekSampler("pmemsave", hmp, reader, qmp=src.cmd), reader.close
    if mode == "pmemsave":
        raise UsageError("--set sampler=pmemsave: the source QEMU does not run on this host")
    return PeekSampler("xp", hmp, XpReader(hmp), qmp=src.cmd), lambda: None


async def context(src: QmpEnd, plan: Plan, hints: Hints,
                  switch: bool | None = None,
                  queried: asyncio.Event | None = None,
                  idle_window: float | None = None) -> encoding.Context:
    """The link (or --bandwidth), the CPUs beside the vCPUs, the guest's RAM and what
    this QEMU's multifd can encode with, all read from QEMU where QEMU knows it;
    ``switch``: whether both ends can switch codecs, when the caller knows already;
    ``queried``: set once the queries are answered, before the idle CPUs' reading
    waits out its window (``idle_window``: a shorter one than the meter's)."""
    vcpus = len(await src.cmd("query-cpus-fast"))
    mem = await src.cmd("query-memory-size-summary")
    ram = int(mem.get("base-memory", 0)) + int(mem.get("plugged-memory", 0) or 0)
    params = await src.cmd("query-migrate-parameters")
    link, link_from = await link_rate(src, plan, hints, params)
    codecs = await multifd_codecs(src)
    if hints.dst_codecs is not None:
        codecs &= hints.dst_codecs
    if switch is None:
        switch = (bool(hints.dst_switch) and SWITCH_CAP not in plan.explicit
                  and await _has_switch(src))
    if queried is not None:
        queried.set()
    return encoding.Context(
        link_rate=link,
        link_from=link_from,
        cpus=(hints.cpus if hints.cpus is not None
              else encoding.migration_cpus(vcpus, dst_local=hints.dst_local)),
        guest_ram=ram or (1 << 30),
        host_available=(hints.host_available if hints.host_available is not None
                        else encoding.host_available()),
        codecs=codecs,
        # QEMU refuses lz4's delta cache beside postcopy-ram (patch 0005)
        delta=(encoding.DELTA_KEY in params and hints.dst_delta is not False
               and not plan.postcopy),
        switch=switch,
        tls=hints.tls if hints.tls is not None else plan.tls is not None,
        dst_local=hints.dst_local,
        # read only for a choice (its wait is the user's): a set encoding takes no level
        idle_cpus=(await hints.idle.idle_cpus(idle_window)
                   if hints.idle is not None and plan.livemig_setting("encoding") == "auto"
                   else None))


async def link_rate(src: QmpEnd, plan: Plan, hints: Hints,
                    params: dict[str, Any] | None = None) -> tuple[float | None, str]:
    """The link's bytes/s for the model and where it came from: ``--set link-rate``,
    else the caller's (the lab's testbed), else the source host's route to the
    destination (:mod:`livemig.engine.linkprobe`, a QEMU on this host); capped by
    ``--bandwidth``, or without it by the source QEMU's ``max-bandwidth`` in
    ``params`` (its query-migrate-parameters) when ``hints.qemu_cap``. (None,
    "unknown"): the model's unshaped rate."""
    link, why = hints.link_rate, "the testbed's link"
    given = plan.livemig_setting("link-rate")
    if given != "auto":
        bits = parse_link_rate(given)
        link, why = (bits / 8 if bits else None), "--set link-rate"
    elif link is None:
        why = "unknown"
        peer = hints.peer or peer_of(plan.uri)
        pid = src.pid if qemu_is_local(src.pid) else (
            hints.local_pid() if hints.local_pid is not None else None)
        if peer is not None and pid is not None:
            found = await asyncio.to_thread(source_link, pid, peer)
            if found is not None:
                link, why = found.rate, found.source
    if plan.bandwidth and (link is None or plan.bandwidth < link):
        link, why = float(plan.bandwidth), "--bandwidth"
    elif not plan.bandwidth and hints.qemu_cap and params is not None:
        cap = qemu_cap(params)
        if cap is not None and (link is None or cap < link):
            link, why = float(cap), f"capped by QEMU's max-bandwidth, {cap_text(cap)}"
    return link, why


# QEMU's default max-bandwidth (migration/options.c: MAX_THROTTLE)
QEMU_DEFAULT_CAP = 128 << 20


def qemu_cap(params: dict[str, Any]) -> int | None:
    """The stream's cap a QEMU's migration parameters set (None: none, or unreadable).
    A stock QEMU that nobody configured sends at most 128 MiB/s (1.07 Gbit/s): a
    hand-started 6 GiB guest over loopback moved 126-140 MiB/s of plain pages in every
    stream, and the model, which took the link for 10 Gbit/s, chose plain pages over
    zstd, which moves twice the pages through the same cap (18.5 s against 13.7 s)."""
    cap = params.get("max-bandwidth")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


def cap_text(cap: int) -> str:
    """How a cap reads in the choice's reason: what it is and how to change it."""
    what = f"{cap / 2**20:.0f} MiB/s"
    if cap == QEMU_DEFAULT_CAP:
        what += " (QEMU's default)"
    return what + "; --bandwidth sets it"


async def _has_switch(src: QmpEnd) -> bool:
    caps = {c["capability"] for c in await src.cmd("query-migrate-capabilities")}
    return SWITCH_CAP in caps


async def multifd_codecs(src: QmpEnd) -> frozenset[str]:
    """The multifd compression methods this QEMU accepts, from its QAPI schema (type
    names there are opaque, so follow query-migrate-parameters' return type)."""
    with contextlib.suppress(LivemigError, KeyError, StopIteration, TypeError):
        schema = await src.cmd("query-qmp-schema")
        by_name = {e["name"]: e for e in schema}
        cmd = next(e for e in schema if e.get("meta-type") == "command"
                   and e["name"] == "query-migrate-parameters")
        ret = by_name[cmd["ret-type"]]
        member = next(m for m in ret["members"] if m["name"] == "multifd-compression")
        values = by_name[member["type"]].get("values", [])
        return frozenset(_CODEC_NAMES[v] for v in values if v in _CODEC_NAMES)
    return STOCK_CODECS
