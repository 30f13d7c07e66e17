"""A sample of the guest's rewritten pages, read from the shared RAM backing file."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
from pathlib import Path

PAGE = 4096


def _read(path: Path, offsets: list[int]) -> list[bytes]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            return [m[o:o + PAGE] for o in offsets]


async def rewritten_pages(path: Path, pages: int = 4096, interval: float = 0.5,
                          seed: int = 1) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Look at ``pages`` random non-zero pages twice, ``interval`` apart; return the
    (before, after) pairs of those that changed, and the non-zero pages of the first
    look (what the first pass will send)."""
    size = path.stat().st_size
    rng = random.Random(seed)
    offsets = sorted({rng.randrange(size // PAGE) * PAGE for _ in range(pages * 2)})
    before = await asyncio.to_thread(_read, path, offsets)
    zero = bytes(PAGE)
    keep = [(o, b) for o, b in zip(offsets, before, strict=True) if b != zero][:pages]
    await asyncio.sleep(interval)
    after = await asyncio.to_thread(_read, path, [o for o, _ in keep])
    pairs = [(b, a) for (_, b), a in zip(keep, after, strict=True) if a != b]
    return pairs, [b for _, b in keep]
