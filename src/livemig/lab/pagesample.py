"""A sample of the guest's rewritten pages, read from the shared RAM backing file."""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from livemig.policy import encoding
from livemig.sampling.base import DEFAULT_INTERVAL, DEFAULT_PAGES, SampleResult

PAGE = 4096


@dataclass(frozen=True)
class PageSample:
    pairs: list[tuple[bytes, bytes]]  # (before, after) of the pages that changed
    pages: list[bytes]  # the non-zero pages of the first look that were looked at again
    looked: int  # pages looked at
    nonzero: int  # of those, not zero
    interval: float  # seconds between the two looks

    @property
    def nonzero_share(self) -> float:
        return self.nonzero / max(1, self.looked)


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
    keep = sorted(rng.sample(nonzero, pages)) if len(nonzero) > pages else nonzero
    await asyncio.sleep(interval)
    after = await asyncio.to_thread(_read, path, [o for o, _ in keep])
    pairs = [(b, a) for (_, b), a in zip(keep, after, strict=True) if a != b]
    return PageSample(pairs, [b for _, b in keep], len(offsets), len(nonzero), interval)


class FileSampler:
    """The lab's sampler: reads the guest's shared RAM file directly (no QEMU call)."""

    name = "file"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.waiting = asyncio.Event()
        self.waiting.set()  # no QEMU call at all

    async def sample(self, pages: int = DEFAULT_PAGES,
                     interval: float = DEFAULT_INTERVAL) -> SampleResult:
        t0 = time.monotonic()
        s = await rewritten_pages(self.path, pages, interval)
        sample = await asyncio.to_thread(
            encoding.sample_from_pages, s.pairs, s.pages, s.looked, s.interval,
            frozenset({"zstd", "lz4"}), s.nonzero)
        return SampleResult(sample, self.name, time.monotonic() - t0)
