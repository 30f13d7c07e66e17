"""The stall watchdog: a migration whose bytes stopped moving is cancelled.

A dead link (a cable pulled, a peer gone without a reset) leaves QEMU's migration
thread blocked in ``send``: nothing fails for minutes while the guest may be held
throttled. Before the switchover the source's counters tell: when neither the RAM
bytes sent (``ram.transferred``) nor the disk copy's remainder change for
``stall-timeout`` seconds, the monitor cancels the migration, as ``--max-time``
would, and the throttle goes with it.

Only ``setup`` and ``active`` are watched by :class:`StallWatch`: ``pre-switchover``
is the lab's own disk hand-over, and post-copy cannot be cancelled. In ``device``
(stop-and-copy) QEMU holds its main lock and does not answer QMP until the send
returns, and ``migrate_cancel`` would wait for that lock too: a dead link there
kept the guest paused until TCP gave up (``tcp_retries2``: minutes).
:class:`SwitchoverWatch` covers it: while a ``query-migrate`` goes unanswered, the
bytes the destination acknowledged on the migration connections (the kernel's
count, :mod:`livemig.engine.sockstat`) are watched; when they stop for
``stall-timeout`` seconds the migration is yanked (QMP ``yank`` of the
``migration`` instance, sent out-of-band so it runs without the main lock: QEMU
shuts the migration sockets down, the send fails, the migration fails and QEMU
resumes the source itself). A slow but live final send keeps its acks moving and
is left alone; without the kernel's count (a ``unix:`` URI, no ``ss``) nothing is
yanked.

The default (10 s, ``settings.py``) is above the longest quiet time of a healthy
migration: the patched QEMU's switchover drain waits at most 5 s for the
destination's answer with nothing sent (qemu/patches/0007).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WATCHED = frozenset({"setup", "active"})


@dataclass
class StallWatch:
    timeout: float  # seconds; 0 or less: off
    _progress: tuple[Any, ...] | None = field(default=None, init=False)
    _since: float | None = field(default=None, init=False)

    def feed(self, now: float, status: str, transferred: int | None,
             disk_remaining: int | None = None) -> str | None:
        """One poll (``now`` monotonic seconds); the reason to cancel, or None."""
        if self.timeout <= 0 or status not in WATCHED:
            self._progress, self._since = None, None
            return None
        progress = (status, transferred, disk_remaining)
        if progress != self._progress or self._since is None:
            self._progress, self._since = progress, now
            return None
        idle = now - self._since
        if idle >= self.timeout:
            return (f"stalled: no migration bytes moved for {idle:.0f}s "
                    f"(stall-timeout {self.timeout:g}s; is the link down?)")
        return None


@dataclass
class SwitchoverWatch:
    """The final send's progress while QMP is blocked; ``progress()`` returns the
    acknowledged bytes (None: unknown)."""

    timeout: float  # seconds; 0 or less: off
    progress: Callable[[], int | None]
    _last: int | None = field(default=None, init=False)
    _since: float | None = field(default=None, init=False)

    def reset(self) -> None:
        """QMP answered: the main loop is free again."""
        self._last, self._since = None, None

    def feed(self, now: float, acked: int | None) -> str | None:
        """One look while QMP is blocked; the reason to yank, or None."""
        if self.timeout <= 0 or acked is None:
            self._last, self._since = None, None
            return None
        if acked != self._last or self._since is None:
            self._last, self._since = acked, now
            return None
        idle = now - self._since
        if idle >= self.timeout:
            return (f"stalled during the switchover: the destination acknowledged no "
                    f"migration bytes for {idle:.0f}s while the source was paused "
                    f"(stall-timeout {self.timeout:g}s; is the link down?)")
        return None
