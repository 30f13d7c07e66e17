"""A sampler for any QEMU: random clusters of guest pages read through a reader: once,
again half an interval later (only counted), and a last time an interval later; the
first look's codecs are measured meanwhile, and QEMU's own count over a short window
(:mod:`livemig.sampling.dirtyrate`) is taken after them. A caller's ``settled`` check
may end the sample at the half-way look (the engine's: the guest rewrites too little
for the last look to change the choice, :func:`livemig.policy.encoding.rewrites_negligible`).

The reader is whatever can read guest-physical memory from outside: the QEMU
process's own mapping through ``/proc/PID/mem`` or QMP ``pmemsave`` into a private
file (a QEMU on this host), HMP ``xp`` (anywhere, slowly) or libvirt's
``virDomainMemoryPeek``. Pages are read in clusters of :data:`CLUSTER` pages so that a
sample costs a few hundred monitor calls, not thousands; the clusters start at random
pages of the RAM ranges QEMU reports (:mod:`livemig.sampling.layout`). The interval of
each cluster is measured between its own two reads, so a slow reader does not skew
the dirty rate.

QEMU's window runs while the half-way look waits, not after it: it starts once the
codec timings and the caller's ``quiet`` are over (the bursts that emptied it,
:meth:`PeekSampler._short_window`), and the half-way look comes no sooner than
:data:`FIRST_PASS_S` after its start. One after the other, the two waits made the
sample of a hand-started 1 GiB guest through ``/proc/PID/mem`` 0.33 s: 0.15 s of the
half-way wait, then 0.12 s of the window.

A guest whose RAM is mostly zero (a 1 GiB guest with 250 MiB written: ~500 non-zero
pages of the first 2048 looked at) gets more clusters in its first look, at the share
of non-zero pages the first ones showed, until the sample keeps its non-zero pages or
:data:`MAX_LOOK` times the first batch were read, as many as the reader manages within
:data:`TOP_UP_S` (a slow reader, HMP ``xp`` at ~10 ms a cluster, stays near its first
batch): rewrites are counted among the kept pages only, and with half of them the
half-way look of a whole-page writer found fewer than ``MIN_SAMPLES`` rewritten in 2
runs of 3 (docs/results/handstarted-2026-11-28e).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from livemig.policy import encoding
from livemig.sampling.base import PAGE, SampleResult
from livemig.sampling.dirtyrate import ShortRate
from livemig.sampling.layout import RamRange, parse_mtree

CLUSTER = 16  # pages per read: 64 KiB, libvirt's memory-peek limit per call
PEEK_PAGES = 1024  # non-zero pages kept: a quarter of QEMU's sample, reads cost calls
# From the end of the first look to the start of the last. A cluster's own gap between
# its reads is this plus the time since its first read, ~0.45 s with pipelined pmemsave
# reads on a busy 2-core host; the recorded samples choose the same encoding with that
# gap as with the 0.7 s an interval of 0.5 s gave (tests/unit/test_encoding_recorded.py),
# and the user waits for every second of it before the migration starts.
PEEK_INTERVAL = 0.3
# Reads in flight at once: QEMU answers a monitor's commands in order, so the next
# read waits in its socket while QEMU runs the one before, and neither side waits out
# the other's wake-up on a busy host.
PIPELINE = 8
# how long QEMU's first hashing pass of its short window is left alone before the
# half-way look reads beside it: 4096 pages per GiB take a few ms on this host, the
# 65536 of a 64 GiB guest tens of ms; the half-way wait is usually the longer one
FIRST_PASS_S = 0.05
# clusters a first look reads at most, as multiples of the ``2 × pages / cluster`` it
# starts with: 0.3 ms a pmemsave call here, so the whole first look stays near 0.15 s
MAX_LOOK = 4
# ... and only as many as fit this long after the first look started, at the reader's
# own pace in the first batch: pmemsave's 512 reads take ~0.15 s
TOP_UP_S = 0.2

ZERO = bytes(PAGE)
Read = Callable[[int, int], Awaitable[bytes]]  # (gpa, size) -> bytes
# whether a sample (first and half-way looks) already decides the encoding
Settled = Callable[[encoding.Sample], Awaitable[bool]]
Hmp = Callable[[str], Awaitable[str]]
Command = Callable[..., Awaitable[Any]]
# told the RAM ranges before the first read (the /proc/PID/mem reader maps them)
Prepare = Callable[[list[RamRange]], Awaitable[None]]


def clusters(ranges: list[RamRange], count: int, cluster: int,
             rng: random.Random, ordered: bool = True) -> list[int]:
    """``count`` distinct cluster-aligned start addresses (gpa), uniform over the
    clusters that fit whole in the RAM ranges; in address order, or in the order drawn
    (any prefix is a uniform sample too)."""
    span = cluster * PAGE
    slots = [(r, r.size // span) for r in ranges if r.size >= span]
    n = sum(k for _, k in slots)
    out: list[int] = []
    for i in rng.sample(range(n), min(count, n)):
        for r, k in slots:
            if i < k:
                out.append(r.gpa + i * span)
                break
            i -= k
    return sorted(out) if ordered else out


def _more(pages: int, nonzero: int, calls: int) -> int:
    """Clusters still to read for ``pages`` non-zero pages, at the share of non-zero
    pages per cluster that ``calls`` clusters showed (none: a guest with nothing in
    its RAM yet, nothing more to find)."""
    if nonzero >= pages or nonzero == 0:
        return 0
    return -(-(pages - nonzero) * calls // nonzero)


class PeekSampler:
    def __init__(self, name: str, hmp: Hmp, read: Read, *, cluster: int = CLUSTER,
                 codecs: frozenset[str] = frozenset({"zstd", "lz4"}), seed: int = 1,
                 max_pages: int = PEEK_PAGES, qmp: Command | None = None,
                 settled: Settled | None = None, prepare: Prepare | None = None,
                 notes: Callable[[], dict[str, Any]] | None = None,
                 monitor_reads: bool = True) -> None:
        self.name = name
        self.prepare = prepare
        self.notes = notes  # the reader's own lines for the report's sampler detail
        # asked after the half-way look: True ends the sample there (the caller's model
        # says the last look cannot change its choice: the guest hardly rewrites)
        self.settled = settled
        self.hmp = hmp
        self.qmp = qmp
        self.read = read
        self.cluster = cluster
        self.codecs = codecs
        self.seed = seed
        self.max_pages = max_pages
        self.waiting = asyncio.Event()  # set after the first look: the reads are over
        # awaited before QEMU's short window starts: the caller's own work beside the
        # sample (the engine's context queries) is over
        self.quiet: Callable[[], Awaitable[Any]] | None = None
        # whether the reads go through the QEMU's monitor (all readers but
        # /proc/PID/mem): the caller's own queries then wait for ``waiting``
        self.monitor_reads = monitor_reads

    async def _reads(self, gpas: list[int], span: int) -> list[tuple[float, bytes]]:
        """Each cluster read, in order, with the time its read returned; up to
        :data:`PIPELINE` reads in flight."""
        slots = asyncio.Semaphore(max(1, PIPELINE))

        async def one(gpa: int) -> tuple[float, bytes]:
            async with slots:
                data = await self.read(gpa, span)
                return time.monotonic(), data
        tasks = [asyncio.ensure_future(one(gpa)) for gpa in gpas]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:  # a failed read: the others are not left running
                t.cancel()

    async def _again(self, keep: list[int], first: dict[int, tuple[float, list[bytes]]],
                     span: int) -> tuple[list[tuple[list[bytes], bytes]], float]:
        """The kept clusters read again: (the first look's pages, the new read) each,
        and the mean time since each cluster's first read."""
        gpas = sorted(keep)
        reads = await self._reads(gpas, span)
        out = [(first[gpa][1], data) for gpa, (_, data) in zip(gpas, reads, strict=True)]
        gaps = [t - first[gpa][0] for gpa, (t, _) in zip(gpas, reads, strict=True)]
        return out, statistics.mean(gaps) if gaps else 0.0

    async def _short_window(self, short: ShortRate,
                            codecs: asyncio.Future[Any] | None) -> float | None:
        """Start QEMU's short window once this process's own work beside the sample
        is over: the first look's ``codecs`` timings and the caller's ``quiet`` (the
        engine's context queries); the time it started, or None (refused). QEMU times
        its window from before its first hashing pass; on a host with no core to
        spare, that pass ran beside those bursts for most of the window, the second
        one right after it, and a 6 GiB guest writing 76 MiB/s read 0-19 MiB/s where
        it reads 44-87 alone (docs/results/short-window-2026-11-29)."""
        if codecs is not None:
            await asyncio.wait({codecs})
        if self.quiet is not None:
            await self.quiet()
        await short.start()
        return time.monotonic() if short.started else None

    async def sample(self, pages: int = PEEK_PAGES,
                     interval: float = PEEK_INTERVAL) -> SampleResult:
        t0 = time.monotonic()
        pages = min(pages, self.max_pages)
        ranges = parse_mtree(await self.hmp("info mtree -f"))
        if self.prepare is not None:
            await self.prepare(ranges)
        rng = random.Random(self.seed)
        span = self.cluster * PAGE
        batch = max(1, 2 * pages // self.cluster)
        # in the order drawn: a first batch, then as many more as the guest's zero pages
        # ask for (each batch read in address order)
        drawn = clusters(ranges, MAX_LOOK * batch, self.cluster, rng, ordered=False)
        first: dict[int, tuple[float, list[bytes]]] = {}
        looked = nonzero = 0
        calls = 0
        todo = sorted(drawn[:batch])
        while todo:
            for gpa, (t, data) in zip(todo, await self._reads(todo, span), strict=True):
                split = [data[i:i + PAGE] for i in range(0, len(data), PAGE)]
                looked += len(split)
                nz = sum(1 for p in split if p != ZERO)
                nonzero += nz
                if nz:
                    first[gpa] = (t, split)
            calls += len(todo)
            spent = time.monotonic() - t0
            affordable = int(max(0.0, TOP_UP_S - spent) * calls / max(spent, 1e-6))
            todo = sorted(drawn[calls:calls + min(affordable, _more(pages, nonzero, calls))])
        first_calls = calls
        kept_gpas = sorted(first)
        # keep whole clusters until `pages` non-zero pages are kept
        keep: list[int] = []
        n = 0
        for gpa in rng.sample(kept_gpas, len(kept_gpas)):
            if n >= pages:
                break
            keep.append(gpa)
            n += sum(1 for p in first[gpa][1] if p != ZERO)
        # the first look's codecs are measured while the guest runs on to the next looks
        pages_first = [p for gpa in sorted(keep) for p in first[gpa][1] if p != ZERO]
        codecs_first = asyncio.ensure_future(asyncio.to_thread(
            encoding.measure_codecs, pages_first, self.codecs)) if pages_first else None
        look1_end = time.monotonic()
        look1 = look1_end - t0
        self.waiting.set()
        # QEMU counts the pages dirtied in a short window, while the half-way look waits
        short = (ShortRate(self.qmp, sum(r.size for r in ranges))
                 if self.qmp is not None else None)
        window = (await self._short_window(short, codecs_first)
                  if short is not None else None)
        # a look half-way: with the last one, two points of the rewritten-pages curve
        half_way = look1_end + interval / 2
        if window is not None:
            half_way = max(half_way, window + FIRST_PASS_S)
        await asyncio.sleep(max(0.0, half_way - time.monotonic()))
        mid_reads, mid_gap = await self._again(keep, first, span)
        mid_pairs = _changed(mid_reads)
        calls += len(mid_reads)
        first_codecs = await codecs_first if codecs_first is not None else None
        counted = await short.result() if short is not None else None

        async def model(pairs: list[tuple[bytes, bytes]], gap: float) -> encoding.Sample:
            s = await asyncio.to_thread(encoding.sample_from_pages, pairs, pages_first,
                                        looked, gap, self.codecs, nonzero, first_codecs)
            return dataclasses.replace(s, short_rate=counted[0] if counted else None,
                                       short_interval=counted[1] if counted else None)

        settled = False
        if self.settled is not None and mid_reads:  # the half-way look as the last
            sample = await model(mid_pairs, mid_gap)
            settled = await self.settled(sample)
        if not settled:
            await asyncio.sleep(max(0.0, look1_end + interval - time.monotonic()))
            reads, gap = await self._again(keep, first, span)
            calls += len(reads)
            sample = dataclasses.replace(
                await model(_changed(reads), gap if reads else interval),
                mid_rewritten=len(mid_pairs) if mid_reads else None,
                mid_interval=mid_gap if mid_reads else None)
        return SampleResult(sample, self.name, time.monotonic() - t0,
                            {"calls": calls, "cluster_pages": self.cluster,
                             "first_look_s": round(look1, 3),
                             "first_look_calls": first_calls,
                             **({"settled_at_half_way": True} if settled else {}),
                             **({"short_rate": short.note} if short else {}),
                             **(self.notes() if self.notes is not None else {}),
                             "ram_ranges": [[hex(r.gpa), r.size, r.name] for r in ranges]})


def _changed(reads: list[tuple[list[bytes], bytes]]) -> list[tuple[bytes, bytes]]:
    """(before, after) of each non-zero page of the first look that a read found
    changed."""
    return [(old, new) for before, after in reads for i, old in enumerate(before)
            if old != ZERO and (new := after[i * PAGE:(i + 1) * PAGE]) != old]
