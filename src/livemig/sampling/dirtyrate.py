"""QEMU's own count of the pages a guest dirties in a short window.

``calc-dirty-rate`` in ``dirty-bitmap`` mode (every QEMU since 6.1; a window in
milliseconds since 8.2) turns on dirty logging for the whole guest for ``WINDOW_MS``
and counts the pages dirtied in it. The peek sampler's looks are half a second apart:
a hot set rewritten many times a second looks the same there whether it takes 50 ms
or 400 ms to fill, and that decides how short the last rounds must be (how far QEMU's
auto-converge ladder has to climb). This count says it. It is one QMP command and one
query; under TCG, dirty logging sends each page's first write in the window through
the slow path once, under KVM it write-protects the guest for the window.

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
POLL_S = 0.02
WAIT_S = 5.0  # the window plus QEMU's sync: well under a second; then give up
MIB = 1 << 20

Command = Callable[..., Awaitable[Any]]


class ShortRate:
    def __init__(self, cmd: Command, window_ms: int = WINDOW_MS) -> None:
        self.cmd = cmd
        self.window_ms = window_ms
        self.started = False
        self.note = "not measured"

    async def start(self) -> None:
        try:
            await self.cmd("calc-dirty-rate", **{
                "calc-time": self.window_ms, "calc-time-unit": "millisecond",
                "mode": "dirty-bitmap"})
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
        self.note = f"{int(rate)} MiB/s over {int(ms)} ms (calc-dirty-rate, dirty-bitmap)"
        return float(rate) * MIB, float(ms) / 1000.0
