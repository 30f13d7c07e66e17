"""A host's idle CPUs over a window: cores' worth of CPU time that nothing used.

The encoding model asks before it lets a codec spend more CPU for fewer bytes (a zstd
level above QEMU's default, :func:`livemig.policy.encoding.idle_covers`): on a host
whose guests keep its CPUs busy, that CPU is taken from the guests, and the stream's
own threads wait for it. The counters come from where the source QEMU runs: this
host's ``/proc/stat`` (a QEMU livemig reaches by its pid), or the source libvirt
daemon's ``virNodeGetCPUStats`` (:func:`livemig.virt.sampling.node_counters`).

A :class:`IdleMeter` takes its first reading when it is made and its second when
asked, at least :data:`WINDOW_S` later (:data:`SHORT_WINDOW_S` for the deferred
choice, whose reading would otherwise hold ``migrate`` back): a caller makes it as soon
as it has reached the source, before its checks and negotiation, so that the window
has mostly passed by the time the model asks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# idle time, all time (both in one unit), the host's CPUs
Counters = tuple[float, float, int]
Reader = Callable[[], Counters | None]

# the window a choice made before ``migrate`` reads (its wait overlaps the page
# sample's): /proc/stat counts in 10 ms ticks per CPU
WINDOW_S = 0.3
# ... and where the user would wait for it before ``migrate``: a choice made while the
# migration runs (the patched build's deferred encoding) reads the host before
# ``migrate`` over what the checks took, at least this long (20 ticks on 2 CPUs: the
# idle share to 5 %), instead of holding the start back: on migrations of 4-5 s, the
# 0.3 s wait was 6-7 % of the command (docs/results/handstarted-2026-11-30/)
SHORT_WINDOW_S = 0.1


def proc_stat(path: str = "/proc/stat") -> Counters | None:
    """This host's counters: ``idle`` and ``iowait`` against every state of the
    ``cpu`` line, over the ``cpuN`` lines' count."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = next((ln.split()[1:] for ln in lines if ln.startswith("cpu ")), None)
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    if not total or len(total) < 5 or not cpus:
        return None
    ticks = [float(x) for x in total[:8]]  # guest time is counted in user already
    return ticks[3] + ticks[4], sum(ticks), cpus


def idle_cpus(first: Counters, second: Counters) -> float | None:
    """Cores' worth of idle CPU between two readings (None: no time passed)."""
    spent = second[1] - first[1]
    if spent <= 0:
        return None
    share = (second[0] - first[0]) / spent
    return round(max(0.0, min(1.0, share)) * second[2], 2)


class IdleMeter:
    """Idle CPUs from the first reading (now) to the second (:meth:`idle_cpus`)."""

    def __init__(self, read: Reader, window: float = WINDOW_S) -> None:
        self._read = read
        self._window = window
        self._t0 = time.monotonic()
        self._first = read()

    async def idle_cpus(self, window: float | None = None) -> float | None:
        """None when either reading failed; ``window``: this reading's shortest
        window instead of the meter's."""
        if self._first is None:
            return None
        wait = (self._window if window is None else window) - (time.monotonic() - self._t0)
        if wait > 0:
            await asyncio.sleep(wait)
        second = await asyncio.to_thread(self._read)
        return None if second is None else idle_cpus(self._first, second)


def local() -> IdleMeter:
    """A meter of this host (a QEMU livemig reaches by its pid runs here)."""
    return IdleMeter(proc_stat)
