"""Verify guest RAM: the frozen source against the paused destination, before the
destination runs.

Two backends, chosen per run:

- ``file``: both ends back guest RAM with a file this host can read (the lab's
  ``/dev/shm`` files): exact byte comparison (:mod:`livemig.ramcheck`).
- ``digest``: QEMU's ``x-query-ram-digest`` over QMP (patched QEMU; refused while the
  VM runs), which works between any two hosts: per RAM block, per chunk; a chunk
  that differs is digested again page by page (``chunk-size`` 4096) to name the
  first differing pages.

Neither available: ``skipped`` with the reason.
"""

from __future__ import annotations

import asyncio
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


def where(block: str, offset: int, ram_size: int | None) -> str:
    """A guest-physical address for the main RAM block, else ``block+offset``."""
    if block in MAIN_RAM_BLOCKS and ram_size:
        return f"{offset_to_gpa(offset, ram_size):#x}"
    return f"{block}+{offset:#x}"


async def compare_digests(src: QmpEnd, dst: QmpEnd, chunk: int = CHUNK) -> RamVerdict:
    """Compare block by block, chunk by chunk; drill into differing chunks."""
    t0 = time.monotonic()
    a, b = await asyncio.gather(digest(src, **{"chunk-size": chunk}),
                                digest(dst, **{"chunk-size": chunk}))
    if a.algorithm != b.algorithm or a.chunk_size != b.chunk_size:
        raise VMError(f"{DIGEST_CMD}: the ends answer differently ({a.algorithm}/"
                      f"{a.chunk_size} vs {b.algorithm}/{b.chunk_size})")
    dst_blocks = {blk.name: blk for blk in b.blocks}
    main = next((blk.size for blk in a.blocks if blk.name in MAIN_RAM_BLOCKS), None)
    mismatches: list[str] = []
    bad_pages = bad_chunks = pages = total = drilled = 0
    capped = False
    for sb in a.blocks:
        db = dst_blocks.pop(sb.name, None)
        pages += sb.size // PAGE
        total += sb.size
        if db is None or db.size != sb.size or len(db.digests) != len(sb.digests):
            bad_chunks += len(sb.digests)
            bad_pages += sb.size // PAGE
            mismatches.append(f"{sb.name}: "
                              + ("missing on the destination" if db is None else
                                 f"size {sb.size:#x} vs {db.size:#x}"))
            continue
        for i, (x, y) in enumerate(zip(sb.digests, db.digests, strict=True)):
            if x == y:
                continue
            bad_chunks += 1
            if drilled >= MAX_DRILLED:
                capped = True
                continue
            drilled += 1
            off = sb.offset + i * a.chunk_size
            length = min(a.chunk_size, sb.offset + sb.size - off)
            args = {"block": sb.name, "offset": off, "length": length, "chunk-size": PAGE}
            pa, pb = await asyncio.gather(digest(src, **args), digest(dst, **args))
            pda, pdb = pa.blocks[0].digests, pb.blocks[0].digests
            for j, (p, q) in enumerate(zip(pda, pdb, strict=False)):
                if p != q:
                    bad_pages += 1
                    if len(mismatches) < MAX_REPORTED:
                        mismatches.append(where(sb.name, off + j * PAGE, main))
    for name in dst_blocks:
        mismatches.append(f"{name}: missing on the source")
        bad_chunks += 1
    bad = bad_pages or bad_chunks
    return RamVerdict("mismatch" if bad else "ok", "digest", pages_compared=pages,
                      mismatched_pages=bad_pages, first_mismatches=tuple(mismatches[:MAX_REPORTED]),
                      seconds=time.monotonic() - t0, bytes_compared=total,
                      mismatched_chunks=bad_chunks, capped=capped)


async def verify_ram(src: QmpEnd, dst: QmpEnd, method: str = "auto") -> RamVerdict:
    """Pick the backend (``auto``, ``file`` or ``digest``) and compare. Both ends
    must be stopped."""
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
    if await src.has_command(DIGEST_CMD) and await dst.has_command(DIGEST_CMD):
        return await compare_digests(src, dst)
    if method == "digest":
        return skipped(f"ram-check=digest: this QEMU has no {DIGEST_CMD} (needs the "
                       "patched build)")
    return skipped(f"no shared RAM files and this QEMU has no {DIGEST_CMD} "
                   "(needs the patched build)")
