"""Guest RAM layout from QEMU: where the guest-physical addresses hold RAM.

Read from HMP ``info mtree -f`` (every QEMU has it): the flat view of the system
memory address space lists each RAM range with its guest-physical bounds, so holes
(the PCI hole below 4 GiB), RAM above 4 GiB and several RAM blocks (memory backends,
DIMMs) come from QEMU rather than from assumptions about the machine type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from livemig.errors import VMError

_RANGE = re.compile(r"^\s*([0-9a-f]+)-([0-9a-f]+) \(prio -?\d+, ram\): (\S+)")
MIN_RANGE = 1 << 20  # ranges smaller than this (SMRAM windows, option ROM shadows) skipped


@dataclass(frozen=True)
class RamRange:
    gpa: int
    size: int
    name: str  # the RAM block (memory region) it belongs to


def parse_mtree(text: str) -> list[RamRange]:
    """The RAM ranges of the ``AS "memory"`` flat view, sorted, each at least
    :data:`MIN_RANGE` bytes. A one-line error when there is none."""
    out: list[RamRange] = []
    in_memory = False
    for line in text.splitlines():
        if line.startswith("FlatView"):
            if out:
                break  # the memory AS's view is done
            in_memory = False
            continue
        if line.startswith(" AS "):
            in_memory = in_memory or line.startswith(' AS "memory"')
            continue
        if not in_memory:
            continue
        m = _RANGE.match(line)
        if m:
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            if end + 1 - start >= MIN_RANGE:
                out.append(RamRange(start, end + 1 - start, m.group(3)))
    if not out:
        raise VMError("no guest RAM found in 'info mtree -f' (system memory address space)")
    return sorted(out, key=lambda r: r.gpa)


def total(ranges: list[RamRange]) -> int:
    return sum(r.size for r in ranges)
