"""QEMU's own estimate of how fast a guest dirties pages over a short window.

``calc-dirty-rate`` in its ``page-sampling`` mode (a window in milliseconds needs QEMU
8.2 or later; an older one refuses it) hashes random pages of every RAM block, again after
``WINDOW_MS``, and scales the share that changed to the whole guest. The peek
sampler's looks are half a second apart: a hot set rewritten many times a second
looks the same there whether it fills in 50 ms or 400 ms, and that decides how short
the last rounds must be (how far QEMU's auto-converge ladder has to climb). This
estimate says it. It is one QMP command and one query; QEMU's thread hashes the pages
(``SAMPLE_PAGES`` per GiB, at most ``MAX_SAMPLES`` in all). The ``dirty-bitmap`` mode
would count exactly, but under TCG it counts nothing (10.2 counts pages in the KVM
dirty-log path only: 0 MiB/s measured on a flat-out writer here).

QEMU times the window from before its first hashing pass and sleeps only what is left
of it. A first pass slowed down for most of the window (a 6 GiB guest's 24576 pages
beside livemig's own bursts, on a host with no core to spare) leaves the second pass
right behind it, and the count reads a few ms of dirtying as the window's: the peek
sampler starts the window only once livemig's own work beside it is over. A window
QEMU reports longer than asked does not tell that case apart from a late wake-up on a
busy host (1 GiB guests, whose first pass takes a few ms, read 100-104 ms), so it is
used as reported.

Optional: a QEMU or a connection that refuses it leaves the sample without it (the
report's sampler detail says why), and the model falls back to the looks alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from livemig.errors import LivemigError

WINDOW_MS = 100
SAMPLE_PAGES = 4096  # per GiB, QEMU's maximum is 16384 (default 512)
MAX_SAMPLES = 65536  # pages hashed in all: a 64 GiB guest gets 1024 per GiB
MIN_SAMPLE_PAGES = 128  # QEMU's minimum per GiB
POLL_S = 0.02
WAIT_S = 5.0  # the window plus QEMU's sync: well under a second; then give up
MIB = 1 << 20

Command = Callable[..., Awaitable[Any]]


class ShortRate:
    def __init__(self, cmd: Command, guest_ram: int = 1 << 30,
                 window_ms: int = WINDOW_MS) -> None:
        self.cmd = cmd
        self.window_ms = window_ms
        gib = max(1, guest_ram >> 30)
        self.per_gib = max(MIN_SAMPLE_PAGES, min(SAMPLE_PAGES, MAX_SAMPLES // gib))
        self.started = False
        self.note = "not measured"

    async def start(self) -> None:
        try:
            await self.cmd("calc-dirty-rate", **{
                "calc-time": self.window_ms, "calc-time-unit": "millisecond",
                "mode": "page-sampling", "sample-pages": self.per_gib})
            self.started = True
        except LivemigError as e:
            self.note = f"calc-dirty-rate refused: {e}"

    async def result(self) -> tuple[float, float] | None:
        """(bytes/s dirtied, the window in seconds), or None."""
        if not self.started:
            return None
        deadline = time.monotonic() + WAIT_S
        try:
            while True:
                r = await self.cmd("query-dirty-rate", **{"calc-time-unit": "millisecond"})
                if r.get("status") == "measured":
                    break
                if time.monotonic() > deadline:
                    self.note = f"query-dirty-rate: not measured within {WAIT_S:g}s"
                    return None
                await asyncio.sleep(POLL_S)
        except LivemigError as e:
            self.note = f"query-dirty-rate: {e}"
            return None
        rate, ms = r.get("dirty-rate"), r.get("calc-time")
        if rate is None or not ms:
            self.note = f"query-dirty-rate gave no rate: {r}"
            return None
        self.note = (f"{int(rate)} MiB/s over {int(ms)} ms (calc-dirty-rate, "
                     f"{self.per_gib} pages/GiB)")
        return float(rate) * MIB, float(ms) / 1000.0
