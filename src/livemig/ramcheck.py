"""Exact comparison of guest RAM between the frozen source and the destination.

Both QEMUs back guest RAM with a shared file (``memory-backend-file,share=on``), so
after the switchover — source stopped, destination not yet resumed (``-S``) — the
two files must be byte-identical. The comparison is exact (every byte of every
page), not sampled; mismatches are reported as guest-physical addresses.

The files are read with ``pread``, never mapped: a read fault on a tmpfs hole
allocates a page, so mapping both files of a mostly idle 16 GiB guest filled 32 GiB
of host memory; ``pread`` of a hole returns zeros without allocating. Ranges that
are holes in both files (``SEEK_DATA``) are equal by construction and not read.
"""

from __future__ import annotations

import bisect
import errno
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
        data = _union(data_ranges(fs.fileno(), size) + data_ranges(fd.fileno(), size))
        starts = [a for a, _ in data]
        for off in range(0, size, CHUNK):
            end = min(off + CHUNK, size)
            if not _overlaps(data, starts, off, end):
                continue  # a hole in both files: zeros on both sides
            a, b = os.pread(fs.fileno(), end - off, off), os.pread(fd.fileno(), end - off, off)
            if a == b:
                continue
            for p in range(0, end - off, PAGE):
                if a[p:p + PAGE] != b[p:p + PAGE]:
                    res.mismatched_pages += 1
                    if len(res.first_mismatches) < MAX_REPORTED:
                        res.first_mismatches.append(offset_to_gpa(off + p, ram_size))
        res.pages = size // PAGE
    res.seconds = time.monotonic() - t0
    return res



def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """[start, end) ranges of ``fd`` that may hold data (``SEEK_DATA``/``SEEK_HOLE``);
    the whole file where the file system cannot say."""
    out: list[tuple[int, int]] = []
    off = 0
    try:
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after off
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            out.append((start, end))
            off = end
    except OSError:
        return [(0, size)]
    return out


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlaps(ranges: list[tuple[int, int]], starts: list[int], a: int, b: int) -> bool:
    """Does [a, b) meet any of the sorted, disjoint ``ranges``?"""
    i = bisect.bisect_right(starts, a) - 1
    if i >= 0 and ranges[i][1] > a:
        return True
    return i + 1 < len(ranges) and ranges[i + 1][0] < b
