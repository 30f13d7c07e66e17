"""The stall watchdog: a migration whose bytes stopped moving is cancelled.

A dead link (a cable pulled, a peer gone without a reset) leaves QEMU's migration
thread blocked in ``send``: nothing fails for minutes while the guest may be held
throttled. Before the switchover the source's counters tell: when neither the RAM
bytes sent (``ram.transferred``) nor the disk copy's remainder change for
``stall-timeout`` seconds, the monitor cancels the migration, as ``--max-time``
would, and the throttle goes with it.

Only ``setup`` and ``active`` (and the monitor's disk-first phase, where the disk
copy's bytes copied are watched) are watched by :class:`StallWatch`: ``pre-switchover``
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
is left alone, and so is a destination that reads slowly (its window closed, its
kernel still answering: see :class:`livemig.engine.sockstat.LinkState`) or a source
with nothing left to send; without the kernel's view (a ``unix:`` URI, no ``ss``)
nothing is yanked. The same watch runs after the source completed, while the
engine waits for the destination to finish loading: the last bytes may still be in
the source's socket (``FIN-WAIT-1``) when the link dies, and the source, paused and
intact, resumes as soon as they are known lost rather than after the load timeout.

The default (10 s, ``settings.py``) is above the longest quiet time of a healthy
migration: the patched QEMU's switchover drain waits at most 5 s for the
destination's answer with nothing sent (qemu/patches/0007).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from livemig.engine.observe import DISK_FIRST
from livemig.engine.sockstat import LinkState

# the monitor's disk-first phase too: a copy whose bytes stop is a dead link as well
WATCHED = frozenset({"setup", "active", DISK_FIRST})


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
    migration connections' state (None: unknown)."""

    timeout: float  # seconds; 0 or less: off
    progress: Callable[[], LinkState | None]
    _last: int | None = field(default=None, init=False)
    _since: float | None = field(default=None, init=False)

    def reset(self) -> None:
        """QMP answered: the main loop is free again."""
        self._last, self._since = None, None

    def feed(self, now: float, link: LinkState | None) -> str | None:
        """One look while QMP is blocked; the reason to yank, or None. Dead: the
        acked bytes stood still for the timeout while bytes waited to be acked and
        no ACK at all came for as long."""
        if self.timeout <= 0 or link is None:
            self._last, self._since = None, None
            return None
        if link.acked != self._last or self._since is None:
            self._last, self._since = link.acked, now
            return None
        idle = now - self._since
        if idle < self.timeout or not link.pending:
            return None
        if link.last_ack_s is not None and link.last_ack_s < self.timeout:
            return None  # the peer's kernel answers: a slow reader, not a dead link
        return (f"stalled during the switchover: the destination acknowledged no "
                f"migration bytes for {idle:.0f}s while the source was paused and "
                f"{link.pending} bytes waited (stall-timeout {self.timeout:g}s; is the "
                f"link down?)")
