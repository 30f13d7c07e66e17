"""The stall watchdog: a migration whose bytes stopped moving is cancelled.

A dead link (a cable pulled, a peer gone without a reset) leaves QEMU's migration
thread blocked in ``send``: nothing fails for minutes while the guest may be held
throttled. Before the switchover the source's counters tell: when neither the RAM
bytes sent (``ram.transferred``) nor the disk copy's remainder change for
``stall-timeout`` seconds, the monitor cancels the migration, as ``--max-time``
would, and the throttle goes with it.

Only ``setup`` and ``active`` are watched: in ``device`` (stop-and-copy) QEMU holds
its main lock and does not answer QMP until the send returns (then the QMP
timeout of :mod:`livemig.engine.endpoint` ends the wait), ``pre-switchover`` is the
lab's own disk hand-over, and post-copy cannot be cancelled.

The default (10 s, ``settings.py``) is above the longest quiet time of a healthy
migration: the patched QEMU's switchover drain waits at most 5 s for the
destination's answer with nothing sent (qemu/patches/0007).
"""

from __future__ import annotations

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
