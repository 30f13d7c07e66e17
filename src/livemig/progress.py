"""Live progress on the terminal: one rewritten line on a TTY, a line a second otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from livemig.units import fmt_bytes, fmt_rate


class Progress:
    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self._last_plain = 0.0
        self._open_line = False

    def step(self, message: str) -> None:
        """A phase change or notable event, always on its own line."""
        if not self.enabled:
            return
        self._end_line()
        print(f"livemig: {message}", file=self.stream, flush=True)

    def sample(self, elapsed: float, sample: dict[str, object]) -> None:
        if not self.enabled:
            return
        line = format_sample(elapsed, sample)
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self.stream.flush()
            self._open_line = True
        elif time.monotonic() - self._last_plain >= 1.0:
            print(line, file=self.stream, flush=True)
            self._last_plain = time.monotonic()

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False

    def close(self) -> None:
        if self.enabled:
            self._end_line()


def _num(sample: dict[str, object], key: str) -> float | None:
    v = sample.get(key)
    return float(v) if isinstance(v, int | float) else None


def format_sample(elapsed: float, s: dict[str, object]) -> str:
    throttle = _num(s, "throttle_pct")
    guest = _num(s, "guest_rate_pct")
    eta = _num(s, "eta_s")
    parts = [
        f"[{elapsed:6.1f}s] {s.get('status', '?'):<9}",
        f"round {s.get('rounds', 0)}",
        f"remaining {fmt_bytes(_num(s, 'remaining'))}",
        f"dirty {fmt_rate(_num(s, 'dirty_rate'))}",
        f"bw {fmt_rate(_num(s, 'bandwidth'))}",
        f"throttle {throttle:.0f}%" if throttle is not None else "throttle -",
        f"guest {guest:.0f}%" if guest is not None else "guest -",
    ]
    if _num(s, "remaining_disk"):
        parts.insert(3, f"disk {fmt_bytes(_num(s, 'remaining_disk'))}")
    if _num(s, "deferred_pages"):
        parts.append(f"deferred {s.get('deferred_pages')}")
    if eta is not None:
        parts.append(f"eta {eta:.0f}s")
    return "  ".join(parts)
