"""Deliberate corruption of a migrated guest, to prove that verification fails.

Kinds (``--inject-fault KIND@N``; refused unless explicitly allowed):

- ``ram-byte@GPA``: flip the byte at guest-physical address GPA of the destination's
  RAM. The host comparison must name that page.
- ``disk-byte@OFFSET``: flip a byte of the destination's disk image (``--storage
  copy``). The host image comparison must name that block.
- ``ram-stamped@N`` / ``disk-stamped@N``: flip a byte inside the N-th block (modulo
  their number) that the guest's stamp-and-verify checker owns, so that the guest
  checker must report it too, at the same address.

All of them happen after the switchover and before the destination resumes.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from livemig.errors import LivemigError
from livemig.ramcheck import offset_to_gpa

KINDS = ("ram-byte", "disk-byte", "ram-stamped", "disk-stamped")
BLOCK = 4096
VBLOCK_MAGIC = struct.pack("<Q", 0x6C6D76626C6B3031)  # guest/agent/verify.c
PAYLOAD_OFFSET = 100  # past the checker's 32-byte header: only the checksum breaks


@dataclass(frozen=True)
class Fault:
    kind: str
    address: int  # GPA, image offset, or stamped-block index

    @property
    def target(self) -> str:
        return "disk" if self.kind.startswith("disk") else "ram"


def stamped_blocks(path: Path, limit: int | None = None) -> list[int]:
    """File offsets of 4 KiB blocks that begin with the checker's magic."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None:
            size = min(size, limit)
        if size == 0:
            return []
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            return [off for off in range(0, size - BLOCK + 1, BLOCK)
                    if m[off:off + 8] == VBLOCK_MAGIC]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if not 0 <= offset < size:
            raise LivemigError(f"offset {offset:#x} is beyond {path} ({size} bytes)")
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


def pick_stamped(path: Path, index: int, limit: int | None = None) -> int:
    """Offset of the byte to flip in the index-th stamped block."""
    blocks = stamped_blocks(path, limit)
    if not blocks:
        raise LivemigError(f"no block stamped by the guest checker in {path}: "
                           "the workload needs verify:mem=... (or disk=...)")
    return blocks[index % len(blocks)] + PAYLOAD_OFFSET


def ram_gpa(file_offset: int, ram_size: int) -> int:
    return offset_to_gpa(file_offset, ram_size)
