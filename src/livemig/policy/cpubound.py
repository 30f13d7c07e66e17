"""A first pass starved of CPU: a cheaper codec for the rest of it.

The encoding is chosen from the page sample with a CPU budget for the migration
threads (the host's CPUs beside the guest's vCPUs, at most the two multifd channels)
and codec speeds that are thread CPU time. On a host whose CPUs the guests already
use, the threads get far less: on the busy fleet of 2026-11-28 (set j of
docs/results/evacuate-2026-11-28.md) zstd streams moved 3-9 MB/s of a 12.5 MB/s link,
14-20 MB/s of guest pages, where zstd at level 3 compresses ~145 MB/s per CPU: the
threads had about a tenth of a CPU, and stock's uncompressed pages filled the link.
A starved stream keeps its guest under migration (slowed, under TCG on the slow path
of every first write after a sync) for longer than the link needs, and its
compression takes the CPU from the guests.

The rule, on what QEMU shows during the first pass (``rounds`` ≤ 1): once ``POLLS``
polls have passed in the chosen codec, with the wire rate's median below ``SLOW`` of
the link the stream may use, the CPU it gets is its drain (guest bytes per second,
``page_rate``) over its codec's speed. If that is less than ``STARVED`` of the CPU the
choice assumed, and lz4 at that CPU would drain at least ``GAIN`` times as fast
(:func:`livemig.policy.encoding.page_rate`: lz4 is ~3× zstd-3's speed at ~80 % of
its ratio, so it fills the link where zstd cannot), the stream switches to lz4 once
(patch 0012). After the first pass the encoding's own plan goes on (zstd+delta's
switch to lz4 deltas).

What it cannot tell apart: a stream held below its link by something other than
the CPU (a link shared with more streams than the rate it was told assumed, a slow
destination) uses little CPU too. lz4 then drains ~20 % less at the same wire rate
(its ratio against zstd's), where a starved stream gains at least ``GAIN``; the
reason in the report gives the figures either way.
"""

from __future__ import annotations

import statistics
from collections import deque

from livemig.policy.base import Action, SetCompression, Snapshot
from livemig.policy.encoding import Codec, Context, page_rate

POLLS = 8  # polls in the chosen codec before the rule looks (2 s at 0.25 s)
SLOW = 0.7  # the wire rate below this share of the link: not link-bound
STARVED = 0.5  # the stream gets less than this share of the CPU the choice assumed
GAIN = 1.2  # lz4 must drain this much faster at the CPU the stream gets
TARGET = "lz4"
HUGE = 1e15  # bytes/s: no link limit (a codec's CPU-bound rate)


class CpuBoundCodec:
    name = "cpu-bound-codec"

    def __init__(self, codec: str, method: str, codecs: dict[str, Codec], link: float,
                 cpus: float, tls: bool = False) -> None:
        """``codec``: the first pass's codec as the sample names it (``zstd-3``: zstd at
        level 3), ``method``: its ``multifd-compression``; ``codecs``: the sample's
        first-pass codecs; ``link``: bytes/s the stream may use; ``cpus``: what the
        choice gave the migration threads."""
        self.codec, self.method = codec, method
        self.codecs, self.link, self.cpus, self.tls = codecs, link, cpus, tls
        self.fired = False
        self.wire: deque[float] = deque(maxlen=POLLS)
        self.drain: deque[float] = deque(maxlen=POLLS)

    def decide(self, s: Snapshot) -> list[Action]:
        if self.fired or s.rounds > 1 or self.codec not in self.codecs \
                or TARGET not in self.codecs or self.method == TARGET:
            return []
        if s.bandwidth > 0 and s.page_rate > 0:
            self.wire.append(s.bandwidth)
            self.drain.append(s.page_rate)
        if len(self.drain) < POLLS:
            return []
        wire, drain = statistics.median(self.wire), statistics.median(self.drain)
        if wire >= SLOW * self.link:
            return []
        now = self.codecs[self.codec]
        cpu = drain / page_rate(now, Context(link_rate=HUGE, cpus=1.0, tls=self.tls))
        if cpu >= STARVED * self.cpus:
            return []
        lz4 = page_rate(self.codecs[TARGET], Context(link_rate=self.link, cpus=cpu,
                                                     tls=self.tls))
        if lz4 < GAIN * drain:
            return []
        self.fired = True
        return [SetCompression(
            f"first pass CPU-bound: {wire / 2**20:.1f} MiB/s on the wire of "
            f"{self.link / 2**20:.1f}, {drain / 2**20:.1f} MiB/s of pages drained in "
            f"{self.codec} ({now.speed / 2**20:.0f} MiB/s per CPU): the threads get "
            f"{cpu:.2f} CPU of the {self.cpus:.2f} planned; {TARGET} would drain "
            f"{lz4 / 2**20:.1f} MiB/s: multifd-compression -> {TARGET}", TARGET)]
