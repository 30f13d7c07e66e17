"""Exact comparison of guest RAM between the frozen source and the destination.

Both QEMUs back guest RAM with a shared file (``memory-backend-file,share=on``), so
after the switchover — source stopped, destination not yet resumed (``-S``) — the
two files must be byte-identical. The comparison is exact (every byte of every
page), not sampled; mismatches are reported as guest-physical addresses.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from livemig.errors import LivemigError

PAGE = 4096
CHUNK = 4 << 20
MAX_REPORTED = 16


def q35_below_4g(ram_size: int) -> int:
    """RAM mapped below 4 GiB on q35 (hw/i386/pc_q35.c); the rest starts at 4 GiB."""
    lowmem = 0x80000000 if ram_size >= 0xB0000000 else 0xB0000000
    return min(ram_size, lowmem)


def offset_to_gpa(offset: int, ram_size: int) -> int:
    below = q35_below_4g(ram_size)
    return offset if offset < below else (1 << 32) + (offset - below)


def gpa_to_offset(gpa: int, ram_size: int) -> int:
    below = q35_below_4g(ram_size)
    if gpa < below:
        return gpa
    if gpa < 1 << 32:
        raise LivemigError(f"guest address {gpa:#x} is in the PCI hole, not RAM")
    return below + gpa - (1 << 32)


@dataclass
class RamComparison:
    pages: int = 0
    mismatched_pages: int = 0
    first_mismatches: list[int] = field(default_factory=list)  # guest-physical addresses
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.mismatched_pages == 0

    def as_dict(self) -> dict[str, object]:
        return {
            "result": "ok" if self.ok else "mismatch",
            "pages_compared": self.pages,
            "mismatched_pages": self.mismatched_pages,
            "first_mismatches": [f"{a:#x}" for a in self.first_mismatches],
            "seconds": round(self.seconds, 3),
        }


def compare_ram(src: Path, dst: Path, ram_size: int) -> RamComparison:
    """Compare two RAM backing files page by page."""
    t0 = time.monotonic()
    res = RamComparison()
    with open(src, "rb") as fs, open(dst, "rb") as fd:
        size = os.fstat(fs.fileno()).st_size
        if os.fstat(fd.fileno()).st_size != size:
            raise LivemigError(f"RAM files differ in size: {src} vs {dst}")
        with mmap.mmap(fs.fileno(), size, prot=mmap.PROT_READ) as ms, \
                mmap.mmap(fd.fileno(), size, prot=mmap.PROT_READ) as md:
            for off in range(0, size, CHUNK):
                end = min(off + CHUNK, size)
                if ms[off:end] == md[off:end]:
                    continue
                for p in range(off, end, PAGE):
                    if ms[p:p + PAGE] != md[p:p + PAGE]:
                        res.mismatched_pages += 1
                        if len(res.first_mismatches) < MAX_REPORTED:
                            res.first_mismatches.append(offset_to_gpa(p, ram_size))
        res.pages = size // PAGE
    res.seconds = time.monotonic() - t0
    return res

