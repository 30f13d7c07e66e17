"""Verify guest RAM: the frozen source against the paused destination, before the
destination runs.

Two backends, chosen per run:

- ``file``: both ends back guest RAM with a file this host can read (the lab's
  ``/dev/shm`` files): exact byte comparison (:mod:`livemig.ramcheck`).
- ``digest``: QEMU's ``x-query-ram-digest`` over QMP (patched QEMU; refused while the
  VM runs), which works between any two hosts: per RAM block, per chunk; a chunk
  that differs is digested again page by page (``chunk-size`` 4096) to name the
  first differing pages.

The guest waits paused on the destination while both ends read all of their RAM:
~0.05 s per GiB and side on a quiet host, 0.13-0.16 s per GiB here with both ends
on one busy 2-core host, so seconds for a guest of tens of GiB. With a ``budget``
(seconds; the run's ``ram-check-budget``) the digest is timed first on a
:data:`PROBE` (256 MiB) of the largest block on both ends; when all of RAM fits in what
is left of the budget, at the probe's time per byte of its chunks with data (a zero
chunk is digested at memory speed, qemu/patches/0018, and the rest of RAM may hold
data), it is compared whole, as without one; when it does not, ranges
of :data:`SPAN` bytes picked at random over every block are compared until the
budget is spent, and the verdict says which share of RAM that covered
(``coverage``): a corruption confined to a few pages may then go unseen, one that
touches a whole block or a share of all pages (a dirty-tracking bug) is found.

Each end digests with one thread per vCPU of the paused guest, at least two
(``threads``, qemu/patches/0017: the stopped vCPUs' cores and the waiting migration
thread are idle); a QEMU built before that patch refuses the argument and digests
with one (:class:`Digester`). The verdict says how many (``threads``).

Neither available: ``skipped`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from livemig.engine.endpoint import QmpEnd
from livemig.errors import VMError
from livemig.ramcheck import PAGE, compare_ram, offset_to_gpa

DIGEST_CMD = "x-query-ram-digest"
CHUNK = 4 << 20  # chunk size asked for the first pass
MAX_REPORTED = 16
# Differing chunks digested again page by page to name pages. Each drill-down is two
# digests of one chunk (4 MiB) while both guests are frozen; past this many the
# chunks are only counted, so a destination that differs everywhere costs at most
# MAX_DRILLED x 4 MiB = 64 MiB more digesting, not a second pass over all of RAM.
MAX_DRILLED = 16
MAIN_RAM_BLOCKS = ("pc.ram", "ram0", "/objects/ram0")
# digested first on both ends to time the digest on these hosts; ranges as large,
# since every call costs its own ~10 ms here (QMP to two QEMUs), as much as 64 MiB of
# digest: with 64 MiB ranges an 8 GiB guest got 0.28 s per GiB where one call gets 0.13
PROBE = 256 << 20
# slower than any digest measured (0.13-0.16 s per GiB with both ends on one busy
# 2-core host): RAM that fits the budget even at this rate is compared whole, unprobed
SLOW_S_PER_BYTE = 0.5 / (1 << 30)
_now = time.monotonic  # the budget's clock
SPAN = PROBE  # one sampled range when all of RAM does not fit
# the digest of a chunk of zeroes, by (algorithm, chunk size): the patched QEMU digests
# zero chunks without the digest's rounds (qemu/patches/0018), several times faster
# than chunks with data, so a probe's time is its data chunks' (``data_bytes``)
ZERO_DIGESTS: dict[tuple[str, int], str] = {("mix64x4", 4 << 20): "8b049bb207c6a54f"}
THREADS_MAX = 64  # x-query-ram-digest's limit (RAM_DIGEST_THREADS_MAX)


@dataclass(frozen=True)
class RamVerdict:
    result: str  # ok | mismatch | skipped
    method: str | None = None  # file | digest
    why: str | None = None
    pages_compared: int = 0
    mismatched_pages: int = 0
    first_mismatches: tuple[str, ...] = ()
    seconds: float = 0.0
    bytes_compared: int = 0
    mismatched_chunks: int = 0
    capped: bool = False  # more chunks differed than were drilled into: pages undercounted
    coverage: float | None = None  # share of RAM compared, when a budget cut it short
    budget_s: float | None = None  # the budget that did
    threads: int | None = None  # threads each end digested with (digest)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "result": self.result, "method": self.method,
            "pages_compared": self.pages_compared,
            "mismatched_pages": self.mismatched_pages,
            "first_mismatches": list(self.first_mismatches),
            "seconds": round(self.seconds, 3),
        }
        if self.why:
            d["why"] = self.why
        if self.method == "digest":
            d["mismatched_chunks"] = self.mismatched_chunks
            if self.capped:
                d["pages_counted_in_first_chunks"] = MAX_DRILLED
            gib = self.bytes_compared / (1 << 30)
            d["seconds_per_gib"] = round(self.seconds / gib, 3) if gib else None
            if self.threads is not None:
                d["threads"] = self.threads
            if self.coverage is not None:
                d["coverage"] = round(self.coverage, 4)
                d["budget_s"] = self.budget_s
        return d


def skipped(why: str) -> RamVerdict:
    return RamVerdict("skipped", why=why)


@dataclass(frozen=True)
class DigestBlock:
    name: str
    size: int
    offset: int
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Digest:
    algorithm: str
    chunk_size: int
    blocks: tuple[DigestBlock, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, reply: dict[str, Any]) -> Digest:
        try:
            return cls(
                str(reply["algorithm"]), int(reply["chunk-size"]),
                tuple(DigestBlock(str(b["name"]), int(b["size"]), int(b.get("offset", 0)),
                                  tuple(str(x) for x in b["digests"]))
                      for b in reply["blocks"]))
        except (KeyError, TypeError, ValueError) as e:
            raise VMError(f"{DIGEST_CMD}: unexpected reply ({e!r})") from e


async def digest(end: QmpEnd, **args: Any) -> Digest:
    return Digest.parse(await end.cmd(DIGEST_CMD, **args))


class Digester:
    """``x-query-ram-digest`` with ``threads`` (qemu/patches/0017) on the ends that
    take it: a QEMU built before that patch refuses the argument, and is asked again
    without it (and from then on)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.refused: set[str] = set()  # the ends (by name) that took one thread

    async def __call__(self, end: QmpEnd, **args: Any) -> Digest:
        if self.threads > 1 and end.name not in self.refused:
            try:
                return await digest(end, threads=self.threads, **args)
            except VMError as e:
                if "threads" not in str(e):
                    raise
                self.refused.add(end.name)
        return await digest(end, **args)

    def used(self) -> int:
        """The threads each end digested with: the fewest of them."""
        return 1 if self.refused or self.threads <= 1 else self.threads


async def digest_threads(end: QmpEnd) -> int:
    """Threads for each end's digest: the guest is paused, so its vCPUs' cores are
    idle, and so is the migration thread, which waits for the check: one per vCPU,
    at least two, at most QEMU's 64."""
    try:
        vcpus = len(await end.cmd("query-cpus-fast"))
    except (VMError, OSError, TypeError):
        return 1
    return max(2, min(THREADS_MAX, vcpus))


def where(block: str, offset: int, ram_size: int | None) -> str:
    """A guest-physical address for the main RAM block, else ``block+offset``."""
    if block in MAIN_RAM_BLOCKS and ram_size:
        return f"{offset_to_gpa(offset, ram_size):#x}"
    return f"{block}+{offset:#x}"


def parse_ramblocks(text: str) -> list[tuple[str, int]]:
    """(name, used bytes) of each RAM block in HMP ``info ramblock``'s table."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(\S+)\s+\d+\s*[KMG]?i?B\s+0x[0-9a-fA-F]+\s+(0x[0-9a-fA-F]+)\s", line)
        if m:
            out.append((m.group(1), int(m.group(2), 16)))
    return out


class _Tally:
    """Digest replies of both ends compared chunk by chunk, differing chunks drilled
    into page by page, over any number of (whole or ranged) replies."""

    def __init__(self, src: QmpEnd, dst: QmpEnd, digester: Digester | None = None) -> None:
        self.src, self.dst = src, dst
        self.digest = digester or Digester(1)
        self.mismatches: list[str] = []
        self.bad_pages = self.bad_chunks = self.bytes = self.drilled = 0
        self.capped = False
        self.main: int | None = None  # the main RAM block's size: guest addresses

    async def add(self, a: Digest, b: Digest) -> None:
        if a.algorithm != b.algorithm or a.chunk_size != b.chunk_size:
            raise VMError(f"{DIGEST_CMD}: the ends answer differently ({a.algorithm}/"
                          f"{a.chunk_size} vs {b.algorithm}/{b.chunk_size})")
        dst_blocks = {blk.name: blk for blk in b.blocks}
        if self.main is None:
            self.main = next((blk.size for blk in a.blocks if blk.name in MAIN_RAM_BLOCKS),
                             None)
        for sb in a.blocks:
            db = dst_blocks.pop(sb.name, None)
            span = min(len(sb.digests) * a.chunk_size, max(0, sb.size - sb.offset))
            self.bytes += span
            if db is None or db.size != sb.size or len(db.digests) != len(sb.digests):
                self.bad_chunks += len(sb.digests)
                self.bad_pages += span // PAGE
                self.mismatches.append(f"{sb.name}: "
                                       + ("missing on the destination" if db is None else
                                          f"size {sb.size:#x} vs {db.size:#x}"))
                continue
            for i, (x, y) in enumerate(zip(sb.digests, db.digests, strict=True)):
                if x != y:
                    await self._differs(sb, sb.offset + i * a.chunk_size, a.chunk_size)
        for name in dst_blocks:
            self.mismatches.append(f"{name}: missing on the source")
            self.bad_chunks += 1

    async def _differs(self, sb: DigestBlock, off: int, chunk: int) -> None:
        self.bad_chunks += 1
        if self.drilled >= MAX_DRILLED:
            self.capped = True
            return
        self.drilled += 1
        length = min(chunk, sb.size - off)
        args = {"block": sb.name, "offset": off, "length": length, "chunk-size": PAGE}
        pa, pb = await asyncio.gather(self.digest(self.src, **args),
                                      self.digest(self.dst, **args))
        pda, pdb = pa.blocks[0].digests, pb.blocks[0].digests
        for j, (p, q) in enumerate(zip(pda, pdb, strict=False)):
            if p != q:
                self.bad_pages += 1
                if len(self.mismatches) < MAX_REPORTED:
                    self.mismatches.append(where(sb.name, off + j * PAGE, self.main))

    def verdict(self, seconds: float, coverage: float | None = None,
                budget_s: float | None = None) -> RamVerdict:
        bad = self.bad_pages or self.bad_chunks
        return RamVerdict("mismatch" if bad else "ok", "digest",
                          pages_compared=self.bytes // PAGE, mismatched_pages=self.bad_pages,
                          first_mismatches=tuple(self.mismatches[:MAX_REPORTED]),
                          seconds=seconds, bytes_compared=self.bytes,
                          mismatched_chunks=self.bad_chunks, capped=self.capped,
                          coverage=coverage, budget_s=budget_s,
                          threads=self.digest.used())


async def compare_digests(src: QmpEnd, dst: QmpEnd, chunk: int = CHUNK,
                          budget: float | None = None, seed: int | None = None
                          ) -> RamVerdict:
    """Compare block by block, chunk by chunk; drill into differing chunks. With a
    ``budget`` (seconds), all of RAM only if it fits, else random ranges until the
    budget is spent (see the module's docstring)."""
    t0 = _now()
    dig = Digester(await digest_threads(src))
    tally = _Tally(src, dst, dig)
    whole = {"chunk-size": chunk}
    blocks = await _blocks(src) if budget else []
    total = sum(size for _, size in blocks)
    pair: tuple[Digest, Digest] | None = None
    probe_s = 0.0
    name, size = max(blocks, key=lambda b: b[1]) if blocks else ("", 0)
    probed = min(PROBE, size)
    if budget and total * SLOW_S_PER_BYTE > budget:
        probe = {"chunk-size": chunk, "block": name, "offset": 0, "length": probed}
        t1 = _now()
        with contextlib.suppress(VMError):  # a block QEMU does not migrate: whole
            a, b = await asyncio.gather(dig(src, **probe), dig(dst, **probe))
            pair = (a, b)
        probe_s = _now() - t1
    # what the rest costs if it all held data, at the probe's time per byte of data (a
    # probe of zeroes only: at the slowest rate, so the guest is sampled, not guessed)
    data = max(data_bytes(pair[0]), data_bytes(pair[1])) if pair is not None else probed
    per_byte = probe_s / data if data else SLOW_S_PER_BYTE
    if pair is None or budget is None or per_byte * total <= budget - (_now() - t0):
        await tally.add(*await asyncio.gather(dig(src, **whole), dig(dst, **whole)))
        return tally.verdict(_now() - t0)
    await tally.add(*pair)
    ranges = [(n, off, min(SPAN, sz - off)) for n, sz in blocks
              for off in range(0, sz, SPAN) if (n, off) != (name, 0)]
    random.Random(seed).shuffle(ranges)
    unmigrated: set[str] = set()
    # the time of a range: its bytes at the rate the large ones showed, plus the calls'
    # own cost (which alone is what a small block's range shows)
    spent, digested, call = probe_s, probed, 0.0
    for n, off, length in ranges:
        t = _now()
        if t - t0 + spent / digested * length + call > budget or tally.bad_chunks:
            break  # out of time, or the destination is known to differ already
        if n in unmigrated:
            continue
        args = {"chunk-size": chunk, "block": n, "offset": off, "length": length}
        got = await asyncio.gather(dig(src, **args), dig(dst, **args),
                                   return_exceptions=True)
        if isinstance(got[0], BaseException):  # a block this QEMU does not migrate
            if not isinstance(got[0], VMError):
                raise got[0]
            unmigrated.add(n)
            continue
        if isinstance(got[1], BaseException) and not isinstance(got[1], VMError):
            raise got[1]
        a = got[0]
        # a block the source migrates and the destination does not have: a mismatch
        await tally.add(a, got[1] if isinstance(got[1], Digest)
                        else Digest(a.algorithm, a.chunk_size))
        took = _now() - t
        if length >= SPAN // 2:
            spent, digested = spent + took, digested + length
        else:
            call = max(call, took)
    total -= sum(sz for n, sz in blocks if n in unmigrated)
    return tally.verdict(_now() - t0, coverage=min(1.0, tally.bytes / max(1, total)),
                         budget_s=budget)


def data_bytes(d: Digest) -> int:
    """Bytes of ``d``'s chunks whose digest is not the zero chunk's (all of them where
    that digest is not known)."""
    zero = ZERO_DIGESTS.get((d.algorithm, d.chunk_size))
    return sum(min(d.chunk_size, b.size - b.offset - i * d.chunk_size)
               for b in d.blocks for i, x in enumerate(b.digests) if x != zero)


async def _blocks(end: QmpEnd) -> list[tuple[str, int]]:
    """The RAM blocks by HMP (``info ramblock``); none if this QEMU cannot say."""
    try:
        text = await end.cmd("human-monitor-command", **{"command-line": "info ramblock"})
    except (VMError, OSError):
        return []
    return [(n, size) for n, size in parse_ramblocks(str(text)) if size > 0]


async def verify_ram(src: QmpEnd, dst: QmpEnd, method: str = "auto",
                     budget: float | None = None) -> RamVerdict:
    """Pick the backend (``auto``, ``file`` or ``digest``) and compare. Both ends
    must be stopped. ``budget``: seconds the digest comparison may hold the guest
    paused (None or 0: all of RAM, however long; the file comparison is exact)."""
    sf, df = src.ram_file, dst.ram_file
    files = sf is not None and df is not None and sf.exists() and df.exists()
    if method == "file" and not files:
        return skipped("ram-check=file: the ends have no RAM files this host can read")
    if files and method != "digest" and sf is not None and df is not None:
        size = sf.stat().st_size
        c = await asyncio.to_thread(compare_ram, sf, df, size)
        return RamVerdict(
            "ok" if c.ok else "mismatch", "file", pages_compared=c.pages,
            mismatched_pages=c.mismatched_pages,
            first_mismatches=tuple(f"{x:#x}" for x in c.first_mismatches),
            seconds=c.seconds, bytes_compared=size)
    has = (await src.has_command(DIGEST_CMD), await dst.has_command(DIGEST_CMD))
    if all(has):
        return await compare_digests(src, dst, budget=budget)
    which = ("the destination's QEMU has" if has[0] else
             "the source's QEMU has" if has[1] else "this QEMU has")
    why = f"{which} no {DIGEST_CMD} (needs the patched build)"
    if method == "digest":
        return skipped(f"ram-check=digest: {why}")
    return skipped(f"no shared RAM files and {why}")
