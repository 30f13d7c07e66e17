"""How much of the CPU time the guest's vCPUs asked for they got: the host's contention.

A CPU throttle θ lets a vCPU run ``1 − θ`` of the time, in 10 ms slices. On a busy
host (the migration's own threads, the codec's, other guests) the vCPU also waits in
the run queue for part of each slice: under a 89-90 % throttle a busy database's vCPU
got 83-98 % of the CPU it asked for (docs/results/slow-link-2026-11-30c), and the
guest ran below 10 % of normal for as long as the throttle held. The converge policy
caps a long deep round with this share (:func:`livemig.policy.converge.deep_pct`).

The kernel counts both halves per thread: the nanoseconds a thread ran and the
nanoseconds it was runnable but waited (``/proc/<pid>/task/<tid>/schedstat``, the
scheduler's ``sched_info``, on in every distribution kernel). Their ratio over a
poll, summed over the vCPU threads, is the share of the time they wanted a CPU that
they had one. A throttled vCPU's sleeps are not waits (it is off the run queue), so
the share is the contention alone, at any throttle.

Readers: the local kernel's per-thread figures when the QEMU runs on this host (a lab
or attach QEMU, a libvirt domain whose process is here), libvirt's ``vcpu.<n>.time``
and ``vcpu.<n>.delay`` (the thread's CPU time in the kernel's ticks, and its schedstat
run-queue wait in ns; Debian 12's libvirt 9.0 has both) for a domain on another host,
a share once ``TICKS_ASKED_S`` were asked; none: the share is unknown
and the policy takes the vCPUs as uncontended.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

# (ns run, ns waited in the run queue), summed over the vCPU threads, since they started
Counters = tuple[int, int]
Reader = Callable[[], Counters | None]
# the CPU time the vCPUs must have asked for before a share is given: less (an idle
# guest, a poll too short) says nothing of contention, and the polls add up until then
MIN_ASKED_S = 0.005
# libvirt's ``vcpu.<n>.time`` counts in the kernel's ticks (4-10 ms): a share from it
# needs ten ticks' worth, or a throttled vCPU's 50 ms per poll would read ±20 %
TICKS_ASKED_S = 0.1


def schedstat_reader(pid: int, tids: Sequence[int]) -> Reader:
    """The local kernel's figures for these vCPU threads of process ``pid``; the
    reader returns None once a thread is gone (the QEMU exited) or unreadable."""
    paths = [Path(f"/proc/{pid}/task/{t}/schedstat") for t in tids]

    def read() -> Counters | None:
        run = wait = 0
        try:
            for p in paths:
                fields = p.read_text().split()
                run += int(fields[0])
                wait += int(fields[1])
        except (OSError, ValueError, IndexError):
            return None
        return run, wait
    return read


def libvirt_counters(stats: dict[str, object]) -> Counters | None:
    """libvirt's ``VIR_DOMAIN_STATS_VCPU`` record (``vcpu.<n>.time``,
    ``vcpu.<n>.delay``, ns) as counters; None when it has no ``delay`` (an older
    daemon: its ``wait`` is only counted with the kernel's schedstats sysctl on, and
    a zero there would read as a host without contention)."""
    n = int(str(stats.get("vcpu.current", 0)))
    run = wait = 0
    for i in range(n):
        t, d = stats.get(f"vcpu.{i}.time"), stats.get(f"vcpu.{i}.delay")
        if not isinstance(t, int) or not isinstance(d, int):
            return None
        run += t
        wait += d
    return (run, wait) if n else None


class VcpuShare:
    """Each :meth:`poll`: the vCPUs' share of the CPU they asked for since the last
    share given (0..1), or None (no reading, the first poll, or less than
    ``min_asked_s`` asked since: the next polls add to it)."""

    def __init__(self, read: Reader, min_asked_s: float = MIN_ASKED_S) -> None:
        self.read = read
        self.min_asked_ns = min_asked_s * 1e9
        self._last = read()

    @property
    def reading(self) -> bool:
        """The counters could be read (at the start, or at the last poll)."""
        return self._last is not None

    def poll(self) -> float | None:
        cur = self.read()
        last = self._last
        if cur is None or last is None:
            self._last = cur
            return None
        run, wait = cur[0] - last[0], cur[1] - last[1]
        if run < 0 or wait < 0:  # other threads (a new process): start again
            self._last = cur
            return None
        if run + wait < self.min_asked_ns:
            return None  # too little asked yet: the window grows
        self._last = cur
        return run / (run + wait)
