"""Which stream encoding suits the guest's dirty pages: xbzrle, lz4 multifd or plain.

Decided from a sample of the pages the guest really rewrites (two looks at the same
random pages a moment apart, straight from the shared RAM backing file):

- most rewrites change only a small part of the page (databases updating rows,
  counters, caches touching 64 bytes): ``xbzrle`` sends the delta against the
  previous version — measured 18.7 s / 1.2 GB vs 25.4 s / 1.6 GB for multifd+zstd on a
  hot-set writer touching 64 B per write;
- whole pages are rewritten but their content compresses (``mixed``: about 2:1):
  ``lz4`` multifd (patch 2/4), 7× the speed of zlib-1 at a similar ratio;
- the content does not compress (encrypted, already compressed): ``plain`` multifd,
  compression would burn CPU for nothing.

``lz4-delta`` (selected by name only, ``--set encoding=lz4-delta``; the patched QEMU's
``x-multifd-lz4-delta-cache-size``) gives the small-write case both: pages sent again
go as XOR deltas against their last sent version, inside the lz4 multifd channels.
"""

from __future__ import annotations

import statistics
import zlib
from dataclasses import dataclass

PAGE = 4096
SMALL_DELTA = 0.15  # share of a page's bytes that change in a "small" rewrite
COMPRESSIBLE = 1.4  # zlib-1 ratio from which compression pays (lz4 gets ~0.9 of it)
MIN_SAMPLES = 16

# a --set of any of these: no automatic choice
KEYS = frozenset({"xbzrle", "xbzrle-cache-size", "multifd", "multifd-channels",
                  "multifd-compression", "x-multifd-lz4-delta-cache-size"})
ENCODINGS: dict[str, dict[str, str]] = {
    "xbzrle": {"xbzrle": "on", "xbzrle-cache-size": "256M", "multifd": "off"},
    "lz4": {"multifd": "on", "multifd-channels": "2", "multifd-compression": "lz4",
            "xbzrle": "off"},
    "plain": {"multifd": "on", "multifd-channels": "2", "multifd-compression": "none",
              "xbzrle": "off"},
    # lz4 multifd with delta encoding of re-sent pages (QEMU patch: multifd lz4 delta)
    "lz4-delta": {"multifd": "on", "multifd-channels": "2", "multifd-compression": "lz4",
                  "x-multifd-lz4-delta-cache-size": "256M", "xbzrle": "off"},
}


@dataclass(frozen=True)
class Choice:
    encoding: str
    reason: str
    changed_share: float | None = None  # median share of bytes changed per rewrite
    ratio: float | None = None  # median zlib-1 ratio of the rewritten pages
    samples: int = 0


def changed_share(old: bytes, new: bytes) -> float:
    """Share of bytes that differ between two versions of a page."""
    diff = sum(1 for a, b in zip(old, new, strict=True) if a != b)
    return diff / len(new)


def choose(pairs: list[tuple[bytes, bytes]], default: str = "xbzrle") -> Choice:
    """``pairs``: (before, after) of pages that changed between two looks."""
    if len(pairs) < MIN_SAMPLES:
        return Choice(default, f"only {len(pairs)} rewritten pages seen: default {default}",
                      samples=len(pairs))
    share = statistics.median(changed_share(a, b) for a, b in pairs)
    ratio = statistics.median(len(b) / max(1, len(zlib.compress(b, 1))) for _, b in pairs)
    facts = (f"{len(pairs)} rewritten pages: median {100 * share:.1f}% of bytes changed, "
             f"zlib-1 ratio {ratio:.2f}")
    if share <= SMALL_DELTA:
        return Choice("xbzrle", f"{facts}: small deltas", share, ratio, len(pairs))
    if ratio >= COMPRESSIBLE:
        return Choice("lz4", f"{facts}: whole pages, compressible", share, ratio, len(pairs))
    return Choice("plain", f"{facts}: whole pages, incompressible", share, ratio, len(pairs))
