"""A sample of the guest's rewritten pages, read from the shared RAM backing file."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096


@dataclass(frozen=True)
class PageSample:
    pairs: list[tuple[bytes, bytes]]  # (before, after) of the pages that changed
    pages: list[bytes]  # the non-zero pages of the first look
    nonzero_share: float  # share of all pages looked at that were not zero
    interval: float  # seconds between the two looks


def _read(path: Path, offsets: list[int]) -> list[bytes]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            return [m[o:o + PAGE] for o in offsets]


async def rewritten_pages(path: Path, pages: int = 4096, interval: float = 0.5,
                          seed: int = 1) -> PageSample:
    """Look at random pages (twice ``pages``) and keep up to ``pages`` non-zero ones,
    then look at those again ``interval`` later."""
    size = path.stat().st_size
    rng = random.Random(seed)
    offsets = sorted({rng.randrange(size // PAGE) * PAGE for _ in range(pages * 2)})
    before = await asyncio.to_thread(_read, path, offsets)
    zero = bytes(PAGE)
    nonzero = [(o, b) for o, b in zip(offsets, before, strict=True) if b != zero]
    share = len(nonzero) / max(1, len(offsets))
    keep = sorted(rng.sample(nonzero, pages)) if len(nonzero) > pages else nonzero
    await asyncio.sleep(interval)
    after = await asyncio.to_thread(_read, path, [o for o, _ in keep])
    pairs = [(b, a) for (_, b), a in zip(keep, after, strict=True) if a != b]
    return PageSample(pairs, [b for _, b in keep], share, interval)
