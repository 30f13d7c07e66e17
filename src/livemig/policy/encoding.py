"""Which stream encoding suits the guest's dirty pages, the link and the CPU left.

Decided from a sample of the pages the guest really rewrites (two looks at the same
random pages a moment apart, straight from the shared RAM backing file), weighed
against what the stream can use (the link or ``--bandwidth``) and the host CPUs the
migration threads get beside the vCPUs:

- most rewrites change only a small part of the page (databases updating rows,
  counters, caches touching 64 bytes): send the delta against the version sent
  before. With the patched QEMU that is ``lz4-delta`` — XOR deltas inside the lz4
  multifd channels, so small writes get both the delta and the parallelism
  (measured 0.18× the time and 0.16× the bytes of multifd zstd with a 512 MiB cache
  on a flat-out 128 B-write hot set). Its cache must hold the pages that are sent
  again, so it is sized from the guest: half its RAM (the hot set cannot be told from
  a 0.5 s sample), within a share of the host's free memory. Stock QEMU: ``xbzrle``
  (one thread, but deltas).
- whole pages are rewritten: every codec the QEMU has (``zstd`` level 1, ``lz4``,
  ``plain``) is run on the sampled pages, packed like a multifd packet, here on this
  host; each one's page rate is ``min(cpus × compress speed, link × ratio)`` — the
  CPU or the link, whichever binds first — and the fastest wins (ties, within
  ``TIE``, go to the fewer bytes). On a 1 gbit link a codec's ratio decides
  (zstd-1: 2.35 on mixed data against lz4's 1.98); on a fast link with one spare
  CPU its speed does (lz4 moves 1.8× zstd-1's pages per core); data that does not
  compress goes ``plain``, compressing it would burn CPU for nothing.
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import lz4.block
import zstandard

PAGE = 4096
SMALL_DELTA = 0.15  # share of a page's bytes that change in a "small" rewrite
MIN_SAMPLES = 16
PACKET_PAGES = 128  # pages per multifd packet: codecs are timed on packets
TIE = 0.10  # page rates within 10 % of the best: the fewer bytes win
UNSHAPED = 10e9 / 8  # bytes/s assumed when nothing caps the stream
# bytes/s one CPU sends uncompressed (the testbed's 10gbit link carried 7.9 Gbit/s,
# CPU-bound on 2 CPUs: ~1 GB/s per CPU for both ends' socket work)
PLAIN_SPEED = 1e9
RATIO_STEP = 0.05  # ratios this close count as equal (then the cheaper codec wins)
MIN_DELTA_CACHE = 64 << 20
HOST_SHARE = 4  # the delta cache takes at most 1/4 of the host's available memory
DELTA_KEY = "x-multifd-lz4-delta-cache-size"

# a --set of any of these: no automatic choice
KEYS = frozenset({"xbzrle", "xbzrle-cache-size", "multifd", "multifd-channels",
                  "multifd-compression", "multifd-zstd-level", DELTA_KEY})
_MULTIFD = {"multifd": "on", "multifd-channels": "2", "xbzrle": "off"}
ENCODINGS: dict[str, dict[str, str]] = {
    "xbzrle": {"xbzrle": "on", "xbzrle-cache-size": "256M", "multifd": "off"},
    "zstd": {**_MULTIFD, "multifd-compression": "zstd", "multifd-zstd-level": "1"},
    "lz4": {**_MULTIFD, "multifd-compression": "lz4"},
    "plain": {**_MULTIFD, "multifd-compression": "none"},
    # lz4 multifd with delta encoding of re-sent pages (QEMU patch: multifd lz4 delta)
    "lz4-delta": {**_MULTIFD, "multifd-compression": "lz4", DELTA_KEY: "256M"},
}


@dataclass(frozen=True)
class Context:
    """What the stream has to work with."""

    link_rate: float | None = None  # bytes/s the stream may use; None: unshaped
    cpus: float = 1.0  # host CPUs the migration threads get beside the vCPUs
    guest_ram: int = 1 << 30
    host_available: int | None = None  # bytes of host memory available (MemAvailable)
    codecs: frozenset[str] = frozenset({"zstd", "plain"})  # multifd codecs of the QEMU
    delta: bool = False  # the QEMU has lz4 delta encoding (patched)


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


def changed_share(old: bytes, new: bytes) -> float:
    """Share of bytes that differ between two versions of a page."""
    diff = sum(1 for a, b in zip(old, new, strict=True) if a != b)
    return diff / len(new)


_COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "zstd": zstandard.ZstdCompressor(level=1).compress,
    "lz4": lambda b: lz4.block.compress(b, store_size=False),
}


def measure_codecs(pages: list[bytes], names: frozenset[str],
                   min_time: float = 0.02) -> dict[str, Codec]:
    """Each codec's ratio and one-CPU speed on ``pages`` packed into packets."""
    packets = [b"".join(pages[i:i + PACKET_PAGES]) for i in range(0, len(pages), PACKET_PAGES)]
    size = sum(len(p) for p in packets)
    out = {"plain": Codec(1.0, PLAIN_SPEED)}
    for name in sorted(names & set(_COMPRESS)):
        f = _COMPRESS[name]
        n, t0 = 0, time.perf_counter()
        while True:
            packed = sum(len(f(p)) for p in packets)
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        ratio = size / max(1, packed)
        # a CPU compresses, then sends the compressed bytes
        out[name] = Codec(ratio, 1.0 / (dt / (n * size) + 1.0 / (ratio * PLAIN_SPEED)))
    return out


def page_rate(c: Codec, ctx: Context) -> float:
    """Guest bytes per second the stream moves with codec ``c``: CPU- or link-bound."""
    link = ctx.link_rate or UNSHAPED
    return min(ctx.cpus * c.speed, link * c.ratio)


def fastest(codecs: dict[str, Codec], ctx: Context) -> tuple[str, dict[str, float]]:
    rates = {n: page_rate(c, ctx) for n, c in codecs.items()}
    top = max(rates.values())
    near = [n for n in rates if rates[n] >= (1 - TIE) * top]
    # among the near-fastest: the fewer bytes, then the cheaper codec
    return max(near, key=lambda n: (round(codecs[n].ratio / RATIO_STEP),
                                    codecs[n].speed)), rates


def delta_cache(ctx: Context) -> int:
    """Half the guest's RAM, a power of two, within 1/HOST_SHARE of the host's
    available memory."""
    want = ctx.guest_ram // 2
    if ctx.host_available:
        want = min(want, ctx.host_available // HOST_SHARE)
    size = MIN_DELTA_CACHE
    while size * 2 <= want:
        size *= 2
    return size


def choose(pairs: list[tuple[bytes, bytes]], ctx: Context | None = None,
           pages: list[bytes] | None = None) -> Choice:
    """``pairs``: (before, after) of pages that changed between two looks; ``pages``:
    the non-zero pages seen (what the first pass sends). A guest that rewrites too
    little to judge deltas is encoded for its first pass: the fastest codec on its
    pages, or plain multifd (zero pages are found by the channels) when none is seen."""
    ctx = ctx or Context()
    if len(pairs) < MIN_SAMPLES:
        facts = f"only {len(pairs)} rewritten pages seen"
        if not pages or len(pages) < MIN_SAMPLES:
            return Choice("plain", f"{facts}, {len(pages or [])} non-zero: plain multifd",
                          samples=len(pairs))
        return _fastest_codec(pages, ctx, f"{facts}; {len(pages)} non-zero pages",
                              None, len(pairs))
    share = statistics.median(changed_share(a, b) for a, b in pairs)
    ratio = statistics.median(len(b) / max(1, len(zlib.compress(b, 1))) for _, b in pairs)
    facts = (f"{len(pairs)} rewritten pages: median {100 * share:.1f}% of bytes changed, "
             f"zlib-1 ratio {ratio:.2f}")
    if share <= SMALL_DELTA:
        if ctx.delta:
            cache = delta_cache(ctx)
            return Choice("lz4-delta", f"{facts}: small deltas, {cache >> 20} MiB delta "
                          "cache (half the guest's RAM)", share, ratio, len(pairs),
                          settings={DELTA_KEY: f"{cache >> 20}M"})
        return Choice("xbzrle", f"{facts}: small deltas", share, ratio, len(pairs))
    return _fastest_codec([b for _, b in pairs], ctx, f"{facts}: whole pages", share,
                          len(pairs))


def _fastest_codec(pages: list[bytes], ctx: Context, facts: str, share: float | None,
                   samples: int) -> Choice:
    codecs = measure_codecs(pages, ctx.codecs)
    name, rates = fastest(codecs, ctx)
    ratio = statistics.median(len(b) / max(1, len(zlib.compress(b, 1))) for b in pages)
    link = f"{(ctx.link_rate or UNSHAPED) * 8 / 1e6:.0f} Mbit/s"
    why = ", ".join(f"{n} {r / 2**20:.0f}" for n, r in sorted(rates.items()))
    return Choice(name, f"{facts}; MiB/s of pages at {link} and {ctx.cpus:g} CPU: {why}",
                  share, ratio, samples, page_rates=rates)


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


def migration_cpus(vcpus: int) -> float:
    """Host CPUs left to the migration threads beside ``vcpus`` busy vCPUs (at least
    half of one), at most the two multifd channels."""
    cpus = len(os.sched_getaffinity(0))
    return max(0.5, min(2.0, float(cpus - vcpus)))
