"""Exact comparison of the source and destination disk images at switchover.

With ``--storage copy`` each host has its own image; when the source has stopped and
the mirror has finished, the destination image must equal the source image byte for
byte. Mismatching blocks are named by their offset in the image.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 4096
CHUNK = 4 << 20
MAX_REPORTED = 16


@dataclass
class DiskComparison:
    blocks: int = 0
    mismatched_blocks: int = 0
    first_mismatches: list[int] = field(default_factory=list)  # byte offsets
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.mismatched_blocks == 0

    def as_dict(self) -> dict[str, object]:
        return {
            "result": "ok" if self.ok else "mismatch",
            "block_size": BLOCK,
            "blocks_compared": self.blocks,
            "mismatched_blocks": self.mismatched_blocks,
            "first_mismatches": [f"{o:#x}" for o in self.first_mismatches],
            "seconds": round(self.seconds, 3),
        }


def compare_images(src: Path, dst: Path) -> DiskComparison:
    """Compare two raw images block by block (a missing tail counts as zeros)."""
    t0 = time.monotonic()
    res = DiskComparison()
    with open(src, "rb") as fs, open(dst, "rb") as fd:
        size = max(os.fstat(fs.fileno()).st_size, os.fstat(fd.fileno()).st_size)
        for off in range(0, size, CHUNK):
            a = fs.read(CHUNK).ljust(min(CHUNK, size - off), b"\0")
            b = fd.read(CHUNK).ljust(min(CHUNK, size - off), b"\0")
            if a == b:
                continue
            for p in range(0, len(a), BLOCK):
                if a[p:p + BLOCK] != b[p:p + BLOCK]:
                    res.mismatched_blocks += 1
                    if len(res.first_mismatches) < MAX_REPORTED:
                        res.first_mismatches.append(off + p)
        res.blocks = (size + BLOCK - 1) // BLOCK
    res.seconds = time.monotonic() - t0
    return res

