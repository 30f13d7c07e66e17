"""Which stream encoding suits the guest's pages, the link and the CPU left.

Decided from a sample of the guest's memory (two looks at the same random pages a
moment apart, straight from the shared RAM backing file), weighed against what the
stream can use (the link or ``--bandwidth``) and the host CPUs the migration threads
get beside the vCPUs. Every encoding the QEMU has — ``zstd`` at levels 1 and 3, ``lz4``,
``plain`` multifd and, with the patched QEMU, ``lz4-delta`` (re-sent pages as XOR
deltas inside the lz4 multifd channels) — is timed here on the sampled pages packed
like multifd packets (deltas on the XOR of the two looks), and a small model of
pre-copy (``estimate``) turns each codec's page rate ``min(cpus × speed, link ×
ratio)`` into seconds, bytes and guest work lost:

- a first pass over the guest's non-zero memory: its codec's ratio decides on a slow
  link (zstd-1: 2.35 on mixed data against lz4's 1.98), its speed on a fast one
  with one spare CPU (lz4 moves 1.8× zstd-1's pages per core);
- then rounds re-sending what the guest dirtied meanwhile: small rewrites (databases
  updating rows, counters) compress to a few dozen bytes as deltas, so ``lz4-delta``
  drains them many times faster than any whole-page codec (measured 0.18× the time
  and 0.16× the bytes of multifd zstd on a flat-out 128 B-write hot set); when the
  guest dirties faster than the rounds can halve, a throttle has to help, which
  costs guest work.

The least time plus work lost wins (fewer bytes among near ties). A database that
updates few rows gets zstd (its first pass is its migration); a busy one lz4-delta,
with a source cache that holds every page of the guest's RAM within a quarter of the
host's free memory (a smaller, direct-mapped cache sends rewritten pages whole). Where
both ends can switch codecs mid-stream (patch 0012) a busy one may get ``zstd+delta``
instead: the first pass in zstd, its pages entering the same cache (patch 0013), then
lz4 deltas once the pass is over, when zstd's ratio shortens a link-bound first pass
more than lz4's speed would a CPU-bound one.
Stock QEMU weighs xbzrle beside its multifd codecs for small rewrites (one stream,
whole pages until a page's second re-send, then deltas), its cache sized the same way.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar, cast

import lz4.block  # type: ignore[import-untyped]
import zstandard

from livemig.policy import autoconverge, dirtying
from livemig.policy.converge import FULL_AT
from livemig.policy.dirtying import DirtyCurve

PAGE = 4096
T = TypeVar("T")
SMALL_DELTA = 0.15  # share of a page's bytes that change in a "small" rewrite
MIN_SAMPLES = 16
PACKET_PAGES = 128  # pages per multifd packet: codecs are timed on packets
# pages codecs are timed on (:func:`measure_codecs`): 2 packets. QEMU's own sampler
# times the non-zero ones of 4096 random pages (~250 on the 4 GiB guest of
# docs/results/sampler-cost-2026-11-30)
CODEC_PAGES = 256
ZLIB_PAGES = 64  # rewritten pages whose zlib ratio the report's median is taken over
TIE = 0.10  # estimates within 10 % of the best: the fewer bytes win
# ... unless it costs the guest more than this much more work (seconds): the choice
# with the least harm wins such a tie (a patched source to a stock destination chose
# zstd under the converge throttle over xbzrle within the tie, for 25 % fewer bytes:
# 3.6 s of work lost and 1.7 s below 10 % against 1.2 s and 0,
# docs/results/mixed-builds-2026-11-30)
HARM_TIE_S = 1.0
UNSHAPED = 10e9 / 8  # bytes/s assumed when nothing caps the stream
# bytes/s one CPU sends uncompressed (the testbed's 10gbit link carried 7.9 Gbit/s,
# CPU-bound on 2 CPUs: ~1 GB/s per CPU for both ends' socket work)
PLAIN_SPEED = 1e9
BYTES_TIE = 0.05  # byte counts this close count as equal: then the cheaper CPU wins
MAX_Q = 0.5  # re-send rounds must at least halve: else a throttle has to help
# what an xbzrle choice sets where the converge throttle would be used: QEMU's
# auto-converge and stock's fixed downtime limit (adapt's stock throttle)
XBZRLE_THROTTLE = {"throttle": "auto-converge", "downtime-ramp": "off"}
MIN_DELTA_CACHE = 64 << 20
HOST_SHARE = 4  # the delta cache takes at most 1/4 of the host's available memory
# bytes/s one CPU encrypts and sends over TLS (gnutls, AES-GCM with AES-NI/PCLMUL):
# the source's migration threads took 2.9-4.3 GB/s of extra CPU per byte sent at
# 1gbit (docs/results/tls-cost.md; openssl's AES-256-GCM: 3.7 GB/s here); it costs
# per byte *sent*, so a codec that shrinks the stream pays less of it
TLS_SPEED = 3e9
DELTA_KEY = "x-multifd-lz4-delta-cache-size"
# the capability that lets a running stream change codec (patch 0012; settings.SWITCH_CAP)
SWITCH_KEY = "x-multifd-compression-switch"
# bytes/s of pages QEMU's migration thread xbzrle-encodes (one thread: it compares the
# page with its cached copy and run-length codes the differences)
XBZRLE_SPEED = 5e8
# bytes an xbzrle page costs beyond its changed bytes (run headers), as a share of it
XBZRLE_OVERHEAD = 0.004

# a --set of any of these: no automatic choice
KEYS = frozenset({"xbzrle", "xbzrle-cache-size", "multifd", "multifd-channels",
                  "multifd-compression", "multifd-zstd-level", DELTA_KEY})
CHANNELS = 2  # multifd channels of every multifd encoding
_MULTIFD = {"multifd": "on", "multifd-channels": str(CHANNELS), "xbzrle": "off"}
ENCODINGS: dict[str, dict[str, str]] = {
    "xbzrle": {"xbzrle": "on", "xbzrle-cache-size": "256M", "multifd": "off"},
    "zstd": {**_MULTIFD, "multifd-compression": "zstd", "multifd-zstd-level": "1"},
    "lz4": {**_MULTIFD, "multifd-compression": "lz4"},
    "plain": {**_MULTIFD, "multifd-compression": "none"},
    # lz4 multifd with delta encoding of re-sent pages (QEMU patch: multifd lz4 delta)
    "lz4-delta": {**_MULTIFD, "multifd-compression": "lz4", DELTA_KEY: "256M"},
    # the first pass in zstd, keeping lz4's delta cache (patch 0013), then lz4-delta
    # for the re-sent pages (AFTER_FIRST_PASS; a codec switch: patch 0012)
    "zstd+delta": {**_MULTIFD, "multifd-compression": "zstd", "multifd-zstd-level": "1",
                   DELTA_KEY: "256M", SWITCH_KEY: "on"},
}
# what an encoding sets once the first pass is over (the engine's AfterFirstPass)
AFTER_FIRST_PASS: dict[str, dict[str, str]] = {
    "zstd+delta": {"multifd-compression": "lz4"},
}


@dataclass(frozen=True)
class Context:
    """What the stream has to work with."""

    link_rate: float | None = None  # bytes/s the stream may use; None: unshaped
    link_from: str = ""  # where link_rate was read (said in the choice's reason)
    cpus: float = 1.0  # host CPUs the migration threads get beside the vCPUs
    guest_ram: int = 1 << 30
    host_available: int | None = None  # bytes of host memory available (MemAvailable)
    codecs: frozenset[str] = frozenset({"zstd", "plain"})  # multifd codecs of the QEMU
    delta: bool = False  # the QEMU has lz4 delta encoding (patched)
    # both ends can change the stream's codec while it runs (SWITCH_KEY, patched): the
    # first pass may go in zstd and the re-sent pages as lz4 deltas (zstd+delta)
    switch: bool = False
    tls: bool = False  # the stream is encrypted: each byte sent costs TLS_SPEED's CPU
    # QEMU's own auto-converge throttles (no set-cpu-throttle: a stock QEMU): the rounds
    # are played by :mod:`livemig.policy.autoconverge` instead of :func:`estimate`
    auto_converge: bool = False
    # cores' worth of CPU the source host left idle, measured just before (None: not
    # measured): a codec level that buys bytes with CPU needs it (idle_covers)
    idle_cpus: float | None = None
    # the destination QEMU runs on this host too (attach to local sockets, the lab, a
    # testbed domain): its receive work comes out of the same idle CPUs
    dst_local: bool = False


@dataclass(frozen=True)
class Codec:
    ratio: float  # bytes in ÷ bytes out on the sample
    speed: float  # bytes in per second of one CPU (compress and send)


@dataclass(frozen=True)
class Choice:
    encoding: str
    reason: str
    changed_share: float | None = None  # median share of bytes changed per rewrite
    ratio: float | None = None  # median zlib-1 ratio of the rewritten pages
    samples: int = 0
    settings: dict[str, str] = field(default_factory=dict)  # on top of ENCODINGS[...]
    page_rates: dict[str, float] = field(default_factory=dict)  # modelled, bytes/s

    def applied(self) -> dict[str, str]:
        return {**ENCODINGS[self.encoding], **self.settings}

    def after_first_pass(self) -> dict[str, str]:
        """What the stream switches to once its first pass is over (nothing: none)."""
        return dict(AFTER_FIRST_PASS.get(self.encoding, {}))


def changed_share(old: bytes, new: bytes) -> float:
    """Share of bytes that differ between two versions of a page."""
    return _share(xor(old, new))


def _share(delta: bytes) -> float:
    """Share of non-zero bytes in an XOR delta."""
    return 1.0 - delta.count(0) / len(delta)


_LOCAL = threading.local()


def _zstd(level: int) -> Callable[[bytes], bytes]:
    """zstd at ``level`` with a compressor of the calling thread's own: one
    ``ZstdCompressor`` used by two threads at once crashes the process (python-
    zstandard's objects are not thread-safe; an evacuation samples its domains side
    by side and took SIGSEGV)."""
    def compress(b: bytes) -> bytes:
        per_thread = _LOCAL.__dict__.setdefault("zstd", {})
        c = per_thread.get(level)
        if c is None:
            c = per_thread[level] = zstandard.ZstdCompressor(level=level)
        return cast(bytes, c.compress(b))  # not copied: this is what is timed
    return compress


_COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "zstd": _zstd(1),
    "zstd-3": _zstd(3),  # a level of zstd: LEVELS
    "lz4": lambda b: lz4.block.compress(b, store_size=False),
}
# A codec at another level than QEMU's default, measured on the same pages (the peek
# and file samplers here, the patched QEMU's sampler itself: qemu/patches/0015): the
# codec it belongs to and the settings that select it. A running stream takes a new
# zstd level at its next frame (0014), so the patched build's deferred choice may set
# it too. zstd's own default level, 3, packs the agent's mixed pages 6 % tighter than
# QEMU's 1 at 0.75× its speed (ratio 2.45 against 2.32); on a link-bound stream with a
# CPU to spare that is ~6 % less time (stock 10.2.2, whole-page writer at 50 MiB/s:
# 3.70 s / 206 MiB against 3.92 s / 220 MiB, docs/results/handstarted-2026-11-28f), and
# on a CPU-bound one it loses. Higher levels gain ~1 % more for half the speed again.
LEVELS: dict[str, tuple[str, dict[str, str]]] = {
    "zstd-3": ("zstd", {"multifd-zstd-level": "3"}),
    "zstd-3+delta": ("zstd+delta", {"multifd-zstd-level": "3"}),
}
# a level other than the codec's default is chosen only when the model has it this much
# faster (time plus work lost): below that, its extra CPU is not worth the model's error
LEVEL_GAIN = 0.02
# ... and only when the source host's idle CPUs (measured) cover the level's CPU over
# its modelled run (Estimate.cpu_seconds / seconds): the CPU a level spends beyond the
# default is what the guests leave, or it is taken from them and the stream's own
# threads wait for it. On the busy fleet (five busy 1-vCPU domains on 2 cores, 0.0 idle
# read) zstd-3's first pass of the whole-page writer took 6.0-9.0 s where level 1's
# took 5.1-5.8 s at 100 Mbit/s, for 15 % fewer bytes (docs/results/evacuate-2026-11-29.md);
# the writer alone on the host leaves 0.6-0.8 idle. Not measured: the default level,
# as stock spends.


def codec_of(name: str) -> str:
    """The multifd codec a measured codec (or level of one) belongs to."""
    return LEVELS[name][0] if name in LEVELS else name


def spread(items: list[T], n: int) -> list[T]:
    """At most ``n`` of ``items``, evenly spaced: the samplers list pages by guest
    address, so the first ``n`` would all come from low memory."""
    if len(items) <= n:
        return items
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def measure_codecs(pages: list[bytes], names: frozenset[str],
                   min_time: float = 0.005) -> dict[str, Codec]:
    """Each codec's ratio and one-CPU speed on ``pages`` (at most ``CODEC_PAGES`` of
    them, spread over the list) packed into packets, repeated until ``min_time`` of
    this thread's CPU. On a host whose vCPUs leave no core spare, every millisecond
    here is the guest's: at 20 ms per codec the peek samplers spent ~0.16 s of CPU on
    timings per sample; with 5 ms and every kept page (up to 1024), ~0.07 s; on at most
    256 pages ~0.04 s, which 5 ms per codec sets."""
    pages = spread(pages, CODEC_PAGES)
    packets = [b"".join(pages[i:i + PACKET_PAGES]) for i in range(0, len(pages), PACKET_PAGES)]
    size = sum(len(p) for p in packets)
    out = {"plain": Codec(1.0, PLAIN_SPEED)}
    for name in sorted(n for n in _COMPRESS if codec_of(n) in names):
        f = _COMPRESS[name]
        n, t0 = 0, time.thread_time()
        while True:
            packed = sum(len(f(p)) for p in packets)
            n += 1
            dt = time.thread_time() - t0
            if dt >= min_time:
                break
        ratio = size / max(1, packed)
        # a CPU compresses, then sends the compressed bytes
        out[name] = Codec(ratio, 1.0 / (dt / (n * size) + 1.0 / (ratio * PLAIN_SPEED)))
    return out


def page_rate(c: Codec, ctx: Context) -> float:
    """Guest bytes per second the stream moves with codec ``c``: CPU- or link-bound."""
    link = ctx.link_rate or UNSHAPED
    speed = 1.0 / (1.0 / c.speed + 1.0 / (c.ratio * TLS_SPEED)) if ctx.tls else c.speed
    return min(ctx.cpus * speed, link * c.ratio)


def start_choice(ctx: Context) -> Choice:
    """What a stream that switches to the sample's choice once it is in starts with
    (patches 0012 and 0013; the patched build): zstd, keeping lz4's delta cache (sized
    as for the choice) up to date. zstd is the best codec for the first pass of any
    guest whose pages compress (its whole pages go once whatever the guest does later),
    and every page it sends enters the cache, so a guest that rewrites small parts of
    its pages gets deltas from its first re-send after the switch to lz4-delta. Both
    starts without that cost something (1 GiB guests, 50 MiB/s): lz4 with the cache
    sent ~4 % more of a whole-page writer than zstd (lz4's ratio until the sample was
    in); zstd without the cache sent each page of the records guest's first 0.7 s whole
    twice (6.27 s against 5.61 s sampled first). A choice of zstd drops the cache unless
    the sample saw small rewrites, too few yet (:func:`delta_fallback`).
    A QEMU built without zstd starts with lz4-delta instead. Without the delta cache
    (``ctx.delta`` off: post-copy may follow, and QEMU refuses the cache with
    postcopy-ram) the start is zstd alone, else lz4, else plain."""
    if not ctx.delta:
        name = next((c for c in ("zstd", "lz4") if c in ctx.codecs), "plain")
        return Choice(name, "until the sample is in (no delta cache: the stream may "
                      "turn to post-copy, which QEMU refuses it with)")
    cache = delta_cache(ctx)
    zstd = "zstd" in ctx.codecs
    why = ", for a switch to lz4-delta" if zstd else " (this QEMU has no zstd)"
    return Choice("zstd" if zstd else "lz4-delta", "until the sample is in: every page "
                  f"sent enters the {cache >> 20} MiB delta cache{why}",
                  settings={DELTA_KEY: f"{cache >> 20}M"})


def delta_cache(ctx: Context) -> int:
    """The source's cache of sent pages that re-sent pages are encoded against
    (lz4-delta's, and xbzrle's on a stock QEMU): the smallest power of two that holds
    every page of the guest's RAM, within 1/HOST_SHARE of the host's available memory.

    Both caches are direct-mapped by RAM address (QEMU's xbzrle page cache and patch
    0005's), so with a cache smaller than the RAM, pages share slots: a page sent in
    the first pass and rewritten later is a delta only if no page of its slot was
    sent after it, and is sent whole otherwise. On the busy evacuation fleet (192 MiB
    guests, a 64 MiB cache: half the RAM) the re-sent pages compressed 1.7×, not the
    ~29× their deltas do: most were misses (docs/results/evacuate-2026-11-27.md); the
    patch's own run on a 1 GiB guest took 27 s with a 256 MiB cache and 7 s with 512
    MiB. Memory is touched only as pages are sent (at most the non-zero RAM) and is
    freed when the migration ends."""
    size = MIN_DELTA_CACHE
    while size < ctx.guest_ram:
        size *= 2
    if ctx.host_available:
        while size > MIN_DELTA_CACHE and size > ctx.host_available // HOST_SHARE:
            size //= 2
    return size


def xor(a: bytes, b: bytes) -> bytes:
    """The delta patch 5 sends for a re-sent page: old XOR new."""
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(
        len(a), "little")


@dataclass(frozen=True)
class Estimate:
    """One encoding's modelled migration: a first pass over the non-zero pages, then
    rounds re-sending what the guest dirtied meanwhile."""

    seconds: float
    bytes: float
    work_lost: float  # seconds of guest work a throttle takes to make it converge
    first_rate: float  # page bytes/s of the first pass
    resend_rate: float  # page bytes/s of re-sent pages
    cpu_seconds: float  # one CPU's seconds to encode and send it all

    @property
    def score(self) -> float:
        return self.seconds + self.work_lost


def _throttle(dirty_rate: float, rate: float) -> float:
    """The share a throttle holds the guest at while pages are re-sent at ``rate``: with
    ``q`` = dirty rate ÷ rate above ``MAX_Q`` the rounds do not shrink fast enough on
    their own, so ``1 − MAX_Q / q``."""
    q = dirty_rate / rate
    return max(0.0, 1.0 - MAX_Q / q) if q > 0 else 0.0


def _resends(again: float, dirty_rate: float, rate: float) -> tuple[float, float, float]:
    """Re-sending ``again`` bytes at ``rate`` while the guest dirties ``dirty_rate``:
    the rounds add up to ``again / (1 − q)``, ``q`` capped at ``MAX_Q`` by the
    throttle. (bytes, seconds, throttle)."""
    total = again / (1.0 - min(dirty_rate / rate, MAX_Q))
    return total, total / rate, _throttle(dirty_rate, rate)


def estimate(first: Codec, resend: Codec, nonzero: float, dirty_rate: float,
             ctx: Context) -> Estimate:
    """``nonzero``: guest bytes the first pass sends as data; ``dirty_rate``: distinct
    bytes per second the guest dirties.

    The pages dirtied during the first pass (at most all of them) go again, then what
    was dirtied meanwhile, and so on: with ``q`` = dirty rate ÷ re-send rate the
    rounds add up to ``R / (1 − q)``. When ``q`` exceeds ``MAX_Q`` the rounds do not
    shrink fast enough on their own: a throttle holds the guest at ``1 − MAX_Q / q``
    for the re-send phase, which costs that share of the guest's work."""
    p1, p2 = page_rate(first, ctx), page_rate(resend, ctx)
    t1 = nonzero / p1
    again = min(nonzero, dirty_rate * t1)
    total_again, t2, throttle = _resends(again, dirty_rate, p2)
    return Estimate(t1 + t2, nonzero / first.ratio + total_again / resend.ratio,
                    throttle * t2, p1, p2, nonzero / first.speed + total_again / resend.speed)


def _xbzrle(changed_share: float, ctx: Context) -> tuple[Context, Codec, Codec]:
    """xbzrle's stream: one migration thread (at most one CPU), its whole pages and its
    deltas (``changed_share`` of a page plus run headers)."""
    one = Context(link_rate=ctx.link_rate, cpus=min(ctx.cpus, 1.0), tls=ctx.tls)
    delta = Codec(1.0 / min(1.0, changed_share + XBZRLE_OVERHEAD), XBZRLE_SPEED)
    return one, Codec(1.0, PLAIN_SPEED), delta


def _stream(c: Codec, ctx: Context) -> autoconverge.Stream:
    return autoconverge.Stream(page_rate(c, ctx), c.ratio)


def estimate_auto_converge(first: Codec, resend: Codec, curve: DirtyCurve,
                           ctx: Context) -> Estimate:
    """:func:`estimate` for a QEMU that converges by its auto-converge ladder."""
    # full_at: the throttle from which the profile's switchover-bandwidth policy (on in
    # the livemig profile, whose encoding this chooses) gives QEMU the page rate
    run = autoconverge.simulate(_stream(first, ctx), _stream(resend, ctx), curve,
                                full_at=FULL_AT)
    again = run.page_bytes - curve.nonzero
    return Estimate(run.seconds, run.wire_bytes, run.work_lost, page_rate(first, ctx),
                    page_rate(resend, ctx),
                    curve.nonzero / first.speed + again / resend.speed)


def estimate_xbzrle_auto_converge(changed_share: float, curve: DirtyCurve,
                                  ctx: Context) -> Estimate:
    """xbzrle, as QEMU 10.2 runs it, under auto-converge: one stream, no compression;
    the first pass sends whole pages and caches none of them (``xbzrle_started`` is
    set after it), so a page's first re-send is whole too and enters the cache; only
    later re-sends are deltas (``changed_share`` of the page plus run headers),
    encoded by the one migration thread. The whole-page round needs no throttle to
    shrink: the rounds after it are deltas, however many pages it leaves. (The
    matrix of 2026-11-27, docs/results/attach-matrix-2026-11-27: on small-write hot
    sets xbzrle's first re-send round carried 60-160 MiB of whole pages, and multifd
    zstd beat it on time and bytes on every family but the flat-out database.)"""
    one, plain, delta = _xbzrle(changed_share, ctx)
    whole = _stream(plain, one)
    run = autoconverge.simulate(whole, whole, curve, later=_stream(delta, one),
                                full_at=FULL_AT)
    whole_bytes = sum(run.round_bytes[:2])  # the first pass and the first re-send
    return Estimate(run.seconds, run.wire_bytes, run.work_lost, whole.rate,
                    page_rate(delta, one),
                    whole_bytes / plain.speed + (run.page_bytes - whole_bytes) / delta.speed)


def one_level(est: dict[str, Estimate], idle_cpus: float | None = None,
              dst_local: bool = False) -> dict[str, Estimate]:
    """``est`` with one level of each codec: another level than the default only when
    it scores ``LEVEL_GAIN`` better (the levels differ only in the ratio and speed
    measured on the same pages, so the model compares them directly, not with
    :func:`pick`'s ties, which would give the default level's lower CPU the choice),
    and only when the source host's idle CPUs cover it (:func:`idle_covers`), beside
    the destination's share when it runs on this host too (:func:`level_cpu`)."""
    out = dict(est)
    for name, (codec, _) in LEVELS.items():
        if name in out and codec in out:
            if idle_covers(idle_cpus, level_cpu(out, name, dst_local)) \
                    and out[name].score < (1 - LEVEL_GAIN) * out[codec].score:
                del out[codec]
            else:
                del out[name]
    return out


def mean_cpu(e: Estimate) -> float:
    """CPUs ``e`` keeps busy on average over its modelled run."""
    return e.cpu_seconds / max(e.seconds, 1e-9)


def level_cpu(est: dict[str, Estimate], name: str, dst_local: bool) -> float:
    """CPUs the host needs for level ``name`` of a codec: its stream's mean CPU, plus,
    when the destination QEMU shares the host, the destination's receive work, taken as
    at least what the default level's stream costs the source. Measured on this 2-core
    host with both QEMUs on it (docs/results/handstarted-2026-11-29b): a destination
    used 1.8-2.1 CPU-s per 1 GiB migration on one day, 0.5-0.6 on another, and zstd
    level 3 was slower than level 1 in all 3 pairs where only the source's CPU was
    counted (0.56-0.82 CPUs read idle, 0.63-0.68 needed)."""
    need = mean_cpu(est[name])
    codec = LEVELS[name][0]
    if dst_local and codec in est:
        need += mean_cpu(est[codec])
    return need


def idle_covers(idle_cpus: float | None, need: float) -> bool:
    """The host's idle CPUs (None: not measured) cover ``need`` (:func:`level_cpu`)."""
    return idle_cpus is not None and idle_cpus >= need


def pick(est: dict[str, Estimate]) -> str:
    """The least time plus work lost; among those within ``TIE`` of it (and within
    ``HARM_TIE_S`` of their least work lost: a tie does not buy bytes with the
    guest's work) the fewest bytes, and among byte counts within ``BYTES_TIE`` the
    least CPU."""
    top = min(e.score for e in est.values())
    near = [n for n, e in est.items() if e.score <= (1 + TIE) * top]
    gentlest = min(est[n].work_lost for n in near)
    near = [n for n in near if est[n].work_lost <= gentlest + HARM_TIE_S]
    least = min(est[n].bytes for n in near)
    lean = [n for n in near if est[n].bytes <= (1 + BYTES_TIE) * least]
    return min(lean, key=lambda n: (est[n].cpu_seconds, est[n].bytes))


@dataclass(frozen=True)
class Sample:
    """What any page sampler hands the model: two looks at the same random pages
    ``interval`` seconds apart, reduced to counts and codec measurements. No page
    content: the patched QEMU computes this itself (``x-query-ram-sample``), the other
    samplers compute it here from the pages they read (:func:`sample_from_pages`).

    ``first``: each codec on the non-zero pages of the first look (what the first pass
    sends); ``resend``: on the rewritten pages' second look; ``delta``: on the XOR of
    the rewritten pages' two looks (what patch 5 sends for a re-sent page)."""

    looked: int  # pages looked at
    nonzero: int  # of those, not zero
    kept: int  # non-zero pages looked at again
    rewritten: int  # of the kept pages, changed at the second look
    interval: float  # seconds between the two looks
    changed_share: float | None = None  # median share of bytes changed per rewrite
    zlib_ratio: float | None = None  # median zlib-1 ratio of the rewritten pages
    first: dict[str, Codec] = field(default_factory=dict)
    resend: dict[str, Codec] = field(default_factory=dict)
    delta: dict[str, Codec] = field(default_factory=dict)
    # a look between the two (samplers that read pages themselves): of the kept pages,
    # changed ``mid_interval`` seconds after the first look. Two points of the curve
    # of pages rewritten against time tell a saturated hot set from a cold set that
    # keeps accruing (:mod:`livemig.policy.dirtying`); None: one point, a linear rate
    mid_rewritten: int | None = None
    mid_interval: float | None = None
    # QEMU's own estimate (calc-dirty-rate, page sampling) of the bytes/s the whole
    # guest dirties over a window of ``short_interval`` s: how fast a short round
    # fills, which looks half a second apart cannot see for a hot set
    short_rate: float | None = None
    short_interval: float | None = None

    @property
    def nonzero_share(self) -> float:
        return self.nonzero / max(1, self.looked)


def codec_from_counts(bytes_in: int, bytes_out: int, cpu_s: float) -> Codec:
    """A codec measured elsewhere (by QEMU): ratio, and one CPU's speed to compress and
    send (the same formula as :func:`measure_codecs`)."""
    ratio = bytes_in / max(1, bytes_out)
    per_byte = max(cpu_s, 1e-9) / max(1, bytes_in)
    return Codec(ratio, 1.0 / (per_byte + 1.0 / (ratio * PLAIN_SPEED)))


def sample_from_pages(pairs: list[tuple[bytes, bytes]], pages: list[bytes], looked: int,
                      interval: float, codecs: frozenset[str] = frozenset({"zstd", "lz4"}),
                      nonzero: int | None = None,
                      first: dict[str, Codec] | None = None) -> Sample:
    """The :class:`Sample` of pages read by a sampler that sees page content (the lab's
    RAM file, ``pmemsave``, libvirt's memory peek). ``pairs``: (before, after) of the
    kept pages that changed; ``pages``: the kept non-zero pages of the first look;
    ``first``: the codecs measured on ``pages`` already (a sampler does it while it
    waits for the second look)."""
    share = ratio = None
    deltas = [xor(a, b) for a, b in pairs]
    if pairs:
        share = statistics.median(_share(d) for d in deltas)
        ratio = statistics.median(len(b) / max(1, len(zlib.compress(b, 1)))
                                  for _, b in spread(pairs, ZLIB_PAGES))
    if first is None:
        first = measure_codecs(pages, codecs) if pages else {}
    resend = measure_codecs([b for _, b in pairs], codecs) if pairs else {}
    delta = measure_codecs(deltas, codecs & {"lz4"}) if pairs else {}
    return Sample(looked=looked, nonzero=len(pages) if nonzero is None else nonzero,
                  kept=len(pages), rewritten=len(pairs), interval=interval,
                  changed_share=share, zlib_ratio=ratio, first=first, resend=resend,
                  delta=delta)


def choose(pairs: list[tuple[bytes, bytes]], ctx: Context | None = None,
           pages: list[bytes] | None = None, nonzero_share: float = 1.0,
           interval: float = 0.5) -> Choice:
    """:func:`choose_sample` on page content: ``pairs`` (before, after) of the pages
    that changed between two looks ``interval`` seconds apart; ``pages``: the non-zero
    pages of the first look, ``nonzero_share`` of all pages looked at."""
    ctx = ctx or Context()
    pages = pages if pages is not None else [b for _, b in pairs]
    codecs = ctx.codecs | ({"lz4"} if ctx.delta else set())
    looked = round(len(pages) / nonzero_share) if nonzero_share > 0 else len(pages)
    return choose_sample(sample_from_pages(pairs, pages, looked, interval,
                                           frozenset(codecs)), ctx)


# the choices that send every page whole (no delta cache of their own)
WHOLE_PAGE = frozenset({"zstd", "zstd-3", "lz4", "plain"})
# how a whole-page choice arms the converge throttle's fallback to lz4 deltas
KEEP_CACHE = "keep"  # the start's delta cache stays, deltas from the fallback's first round
NEW_CACHE = "new"  # the cache is dropped; the fallback makes a new one (patch 0019)


def delta_fallback(choice: str, samples: int, changed_share: float | None) -> str | None:
    """How a whole-page choice (:data:`WHOLE_PAGE`) of a stream that started
    with lz4's delta cache (:func:`start_choice`) arms the converge throttle's fallback
    to lz4 deltas (:meth:`~livemig.policy.converge.ConvergeThrottle.arm_delta_fallback`:
    the first time the rounds would need a throttle, the stream goes to lz4 deltas
    instead), or None when it arms nothing.

    - :data:`KEEP_CACHE` when the sample saw the guest rewrite small parts of its pages
      (at least one rewrite, the median changing at most half of its page: patch 0005
      sends a page of which more than half changed whole anyway), too few for deltas to
      pay now. Such a guest (a database updating a few rows) may write more later, a
      batch job or a cache filling during the migration, and the cache that saw every
      page sent makes its re-sends deltas at once: a 1 GiB guest that began writing
      128 B records flat out during its migration (20 MiB/s) took 15.0 s with the cache
      kept, 21.6 s with a new one made by the fallback (its first round's pages miss
      and go whole), and was held at 92-99 % for 5-7 s without either; keeping it cost
      a small writer that stayed quiet nothing measurable (4.35 s against 4.44 s
      dropped, 50 MiB/s; docs/results/delta-cache-again-2026-12-01).
    - :data:`NEW_CACHE` when the sample saw no rewrite at all: nothing says what the
      guest will write if it turns busy, and a cache kept for it would cost the copy of
      every page sent (a quiet 1 GiB guest with 512 MiB written: 4.78 s against 4.43 s
      at 50 MiB/s, its source's CPU 5.8 s against 4.7 s, docs/results/
      late-busy-2026-12-01); the fallback makes a new cache only when a throttle would
      be needed. A guest that turns into a whole-page writer then loses the fallback's
      two rounds before its throttle.
    - None when the sample saw whole-page rewrites: deltas would not pay, and the
      throttle should not wait for them."""
    if choice not in WHOLE_PAGE:
        return None
    if samples <= 0:
        return NEW_CACHE
    return KEEP_CACHE if changed_share is not None and changed_share <= 0.5 else None


def rewrites_negligible(sample: Sample, ctx: Context) -> bool:
    """Whether the guest rewrites so little that no later look can change the choice:
    the highest dirty rate the sample allows is at most ``BYTES_TIE`` of the slowest
    rate at which any encoding sends pages (plain pages on the link or the CPUs).

    Then each re-send round takes at most ``BYTES_TIE`` of the round before it with any
    encoding, so all of them add at most ~5 % to the first pass's time and bytes, and
    no throttle is needed (``q`` ≤ ``BYTES_TIE`` < ``MAX_Q``): an encoding that
    re-sends better gains less than the model's ``TIE``, and the first pass decides,
    which the sample has measured.

    The highest rate: the sample's rewritten share with three more pages (with none
    seen among ``kept``, 3/kept is the 95 % upper bound: the rule of three), and QEMU's
    short-window count when there is one."""
    if sample.kept < MIN_SAMPLES or sample.interval <= 0:
        return False
    nonzero = ctx.guest_ram * sample.nonzero_share
    rate = nonzero * min(1.0, (sample.rewritten + 3) / sample.kept) / sample.interval
    if sample.short_rate is not None:
        rate = max(rate, sample.short_rate)
    return rate <= BYTES_TIE * page_rate(Codec(1.0, PLAIN_SPEED), ctx)


def decided_at_half_way(sample: Sample, ctx: Context) -> bool:
    """Whether a sample's half-way look already decides the encoding, so the peek
    samplers may skip their last look (~0.25 s before `migrate` on a stock QEMU):

    - the guest rewrites too little for any later look to matter
      (:func:`rewrites_negligible`); or
    - it rewrites whole pages (the median rewrite changed more than ``SMALL_DELTA``
      of its page, over at least ``MIN_SAMPLES`` rewritten pages), and the choice is
      the same at the dirty rate the half-way look shows and at half of it.

    Why those bounds hold for the last look, an interval after the first instead of
    half of one: a page changed again in the meantime is counted once, so the pages
    found rewritten at most double, and the rate they give is at most the half-way
    look's; at least, they are the same pages (half the rate). A page looked at later
    has had more of it rewritten, so its share only grows, and small-rewrite encodings
    (xbzrle, and lz4-delta on the patched build) stay out of reach."""
    if rewrites_negligible(sample, ctx):
        return True
    share = sample.changed_share
    if sample.rewritten < MIN_SAMPLES or share is None or share <= SMALL_DELTA:
        return False
    slower = replace(sample, rewritten=max(MIN_SAMPLES, sample.rewritten // 2))
    return choose_sample(sample, ctx).encoding == choose_sample(slower, ctx).encoding


def dirty_curve(sample: Sample, nonzero: float) -> DirtyCurve:
    """The sample's rewritten-pages curve (:func:`livemig.policy.dirtying.fit`) over
    ``nonzero`` bytes: its looks, and QEMU's short-window estimate when it has one."""
    kept = max(1, sample.kept)
    short = None
    if sample.short_rate is not None and sample.short_interval:
        short = (sample.short_rate * sample.short_interval, sample.short_interval)
    return dirtying.fit(nonzero, min(1.0, sample.rewritten / kept), sample.interval,
                        None if sample.mid_rewritten is None
                        else sample.mid_rewritten / kept, sample.mid_interval, short=short)


def choose_sample(sample: Sample, ctx: Context | None = None) -> Choice:
    """Every encoding the QEMU has, modelled on the sample (``estimate``): the first pass
    over the guest's non-zero memory, then the rounds re-sending what the guest dirtied
    meanwhile. The least time plus guest work lost wins; within ``TIE`` the one that
    sends fewer bytes. Without the delta cache small rewrites also get xbzrle
    modelled (:func:`estimate_xbzrle_auto_converge`: one stream, whole pages until a
    page's second re-send, under auto-converge, which the choice then sets)."""
    ctx = ctx or Context()
    n_pages, n_pairs = sample.kept, sample.rewritten
    if n_pages < MIN_SAMPLES:
        return Choice("plain", f"{n_pages} non-zero pages seen: plain multifd (the "
                      "channels find zero pages)", samples=n_pairs)
    nonzero = ctx.guest_ram * sample.nonzero_share
    dirty_rate = nonzero * min(1.0, n_pairs / n_pages) / sample.interval
    share, ratio = sample.changed_share, sample.zlib_ratio
    facts = f"{n_pages} non-zero pages, {n_pairs} rewritten in {sample.interval:.2f}s"
    if n_pairs >= MIN_SAMPLES and share is not None:
        facts += f" (median {100 * share:.1f}% of bytes changed)"
    if sample.short_rate is not None and sample.short_interval:
        facts += (f", QEMU saw {sample.short_rate / 2**20:.0f} MiB/s dirtied over "
                  f"{1000 * sample.short_interval:.0f} ms")
    codecs = ctx.codecs | ({"lz4"} if ctx.delta else set())  # delta rides on lz4
    plain = {"plain": Codec(1.0, PLAIN_SPEED)}
    first = {**plain, **{n: c for n, c in sample.first.items() if codec_of(n) in codecs}}
    again = ({**plain, **{n: c for n, c in sample.resend.items()
                          if codec_of(n) in codecs}}
             if n_pairs >= MIN_SAMPLES else first)
    curve = dirty_curve(sample, nonzero) if ctx.auto_converge else None
    if curve is not None:
        est = {n: estimate_auto_converge(first[n], again.get(n, first[n]), curve, ctx)
               for n in first}
    else:
        est = {n: estimate(first[n], again.get(n, first[n]), nonzero, dirty_rate, ctx)
               for n in first}
    if ctx.delta and "lz4" in first and n_pairs >= MIN_SAMPLES and "lz4" in sample.delta:
        delta = sample.delta["lz4"]
        est["lz4-delta"] = estimate(first["lz4"], delta, nonzero, dirty_rate, ctx)
        if ctx.switch:  # each zstd level's first pass, then the same deltas
            est.update({f"{n}+delta": estimate(c, delta, nonzero, dirty_rate, ctx)
                        for n, c in first.items() if codec_of(n) == "zstd"})
    if not ctx.delta and n_pairs >= MIN_SAMPLES and share is not None \
            and share <= SMALL_DELTA:  # stock QEMU's delta encoding, for small rewrites
        # under auto-converge also where the converge throttle is there (a patched
        # source without the delta cache: a stock destination, or post-copy to
        # follow), which would hold the guest down through xbzrle's whole-page round
        # (docs/results/mixed-builds-2026-11-30)
        est["xbzrle"] = estimate_xbzrle_auto_converge(
            share, curve if curve is not None else dirty_curve(sample, nonzero), ctx)
    name = pick(one_level(est, ctx.idle_cpus, ctx.dst_local))
    link = f"{(ctx.link_rate or UNSHAPED) * 8 / 1e6:.0f} Mbit/s"
    if ctx.link_from:
        link += f" ({ctx.link_from})"
    why = ", ".join(f"{n} {e.seconds:.1f}s+{e.work_lost:.1f}s lost/{e.bytes / 2**20:.0f}MiB"
                    for n, e in sorted(est.items()))
    settings: dict[str, str] = {}
    if name in LEVELS:
        name, settings = LEVELS[name][0], dict(LEVELS[name][1])
    shape = ""
    if curve is not None and curve.linear is None:
        shape = (f" (a hot {100 * curve.hot:.0f}% rewritten at once, the rest at "
                 f"{100 * curve.cold_rate:.0f}%/s; a short round fills at "
                 f"{curve.rate() / 2**20:.0f} MiB/s)")
    how = " under QEMU's auto-converge" if ctx.auto_converge else ""
    idle = ("" if ctx.idle_cpus is None else
            f" ({ctx.idle_cpus:g} idle on the host)")
    reason = (f"{facts}; modelled{how} at {link} and {ctx.cpus:g} CPU{idle} for "
              f"{nonzero / 2**20:.0f} MiB non-zero, {dirty_rate / 2**20:.0f} MiB/s dirtied"
              f"{shape}: {why}")
    needs = {n: level_cpu(est, n, ctx.dst_local) for n in LEVELS if n in est}
    short = [n for n, c in needs.items() if not idle_covers(ctx.idle_cpus, c)]
    if short:
        seen = ("no idle CPUs measured" if ctx.idle_cpus is None
                else f"{ctx.idle_cpus:g} CPUs idle")
        need = max(needs[n] for n in short)
        beside = " with the destination on this host" if ctx.dst_local else ""
        reason += (f"; no level above the default: {seen} on the source host, under the "
                   f"{need:.2f} {'/'.join(short)} would use{beside}")
    if DELTA_KEY in ENCODINGS[name]:  # re-sent pages as deltas: the cache for them
        cache = delta_cache(ctx)
        settings[DELTA_KEY] = f"{cache >> 20}M"
        reason += f"; {cache >> 20} MiB delta cache ({_covers(cache, ctx)})"
    if name in AFTER_FIRST_PASS:
        reason += ("; the first pass in zstd (every page it sends enters the cache), "
                   "the re-sent pages as lz4 deltas once it is over")
    if name == "xbzrle":
        cache = delta_cache(ctx)
        settings["xbzrle-cache-size"] = f"{cache >> 20}M"
        reason += f"; {cache >> 20} MiB xbzrle cache ({_covers(cache, ctx)})"
        if not ctx.auto_converge:  # as modelled: the ladder, and stock's fixed limit
            settings.update(XBZRLE_THROTTLE)
            reason += ("; under QEMU's auto-converge, as modelled (its deltas converge "
                       "once the whole-page round is over)")
    return Choice(name, reason, share, ratio, n_pairs, settings=settings,
                  page_rates={n: e.first_rate for n, e in est.items()})


def _covers(cache: int, ctx: Context) -> str:
    if cache >= ctx.guest_ram:
        return "every page of the guest's RAM"
    return f"{100 * cache / max(ctx.guest_ram, 1):.0f}% of the guest's RAM: the host's memory"


def host_available() -> int | None:
    """MemAvailable of this host, bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def migration_cpus(vcpus: int, host_cpus: int | None = None,
                   dst_local: bool = False) -> float:
    """Host CPUs the migration threads get beside ``vcpus`` busy vCPUs on ``host_cpus``
    (default: this process's), at most the multifd channels: the cores the vCPUs leave
    free, and where they leave none, the share the scheduler gives the channels'
    threads among the vCPUs' and, with the destination QEMU on this host
    (``dst_local``), its receiving channels' (each runnable thread an equal share),
    counted up to one CPU.

    On this 2-core host a hand-started 6 GiB guest with 2 vCPUs, migrated to a QEMU on
    the same host under QEMU's 128 MiB/s cap, moved 176-185 MiB/s of pages with stock's
    zstd: the 0.67 CPU this gives at the sampled zstd speed. Counted at half a CPU
    (host CPUs minus vCPUs, floored), zstd looked slower than plain pages and stock
    livemig sent plain, twice the bytes; counted at one, zstd+delta looked faster than
    lz4-delta and the patched build took 18-20 s where lz4-delta took 15-18 s
    (docs/results/handstarted-2026-11-29d)."""
    cpus = len(os.sched_getaffinity(0)) if host_cpus is None else host_cpus
    threads = CHANNELS + vcpus + (CHANNELS if dst_local else 0)
    share = min(1.0, CHANNELS * cpus / threads)
    return max(0.5, min(float(CHANNELS), max(float(cpus - vcpus), share)))
