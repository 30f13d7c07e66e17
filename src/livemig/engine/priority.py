"""The migration's threads of a source QEMU on this host, below its vCPUs (nice), as
``policy.priority`` says.

The threads there were just before ``migrate`` are taken first; from then on every
poll (:meth:`ThreadPriority.apply`) lowers the migration's new threads. At the end
(:meth:`ThreadPriority.restore`) a lowered thread still alive gets its nice value back,
when it is still the one livemig set: the named migration threads end with the
migration, an unnamed thread of a QEMU that names none may be a thread-pool worker
that does not. Putting a nice value back down needs CAP_SYS_NICE, so without it only
named migration threads are lowered: nothing is left changed.

A livemig that dies mid-migration leaves lowered threads to the guardian, which
cancels the migration: its threads end with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from livemig.engine.pinning import threads
from livemig.policy import priority
from livemig.policy.pinning import is_migration_thread

log = logging.getLogger(__name__)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def may_raise() -> bool:
    """Whether this process may set a nice value back down (root, or CAP_SYS_NICE)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 23))  # CAP_SYS_NICE
    return os.geteuid() == 0


class ThreadPriority:
    """Lowers the migration's threads of the QEMU ``pid`` to ``nice``; created just
    before ``migrate``."""

    def __init__(self, pid: int, nice: int, vcpu_tids: Collection[int]) -> None:
        self.pid = pid
        self.nice = nice
        self.vcpus = frozenset(vcpu_tids)
        self.process_comm = _comm(pid)
        self.before = frozenset(threads(pid))
        self.unnamed = may_raise()  # unnamed new threads only when they can go back
        self.lowered: dict[int, tuple[str, int]] = {}  # tid → (name, nice before)

    def _wanted(self, tid: int, comm: str) -> bool:
        if not priority.lowered(tid, comm, self.process_comm, self.before, self.vcpus):
            return False
        return self.unnamed or is_migration_thread(comm)

    def apply(self) -> None:
        for tid, comm in threads(self.pid).items():
            if tid in self.lowered or not self._wanted(tid, comm):
                continue
            try:
                was = os.getpriority(os.PRIO_PROCESS, tid)
                if was < self.nice:
                    os.setpriority(os.PRIO_PROCESS, tid, self.nice)
            except OSError as e:
                log.info("cannot lower thread %d (%s): %s", tid, comm, e)
                continue
            self.lowered[tid] = (comm, was)

    def restore(self) -> list[str]:
        """Put back the nice value of each lowered thread still alive with it; what
        was done, one line each."""
        done = []
        alive = threads(self.pid)
        for tid, (comm, was) in self.lowered.items():
            if alive.get(tid) != comm:
                continue
            with contextlib.suppress(OSError):
                if os.getpriority(os.PRIO_PROCESS, tid) == self.nice != was:
                    os.setpriority(os.PRIO_PROCESS, tid, was)
                    done.append(f"thread {tid} ({comm}): nice back to {was}")
        return done

    def as_report(self) -> dict[str, Any]:
        return {"nice": self.nice,
                "threads": {str(t): comm for t, (comm, _) in self.lowered.items()}}


def plan_for(pid: int | None, nice: int, vcpu_tids: Collection[int]
             ) -> tuple[ThreadPriority | None, str]:
    """A :class:`ThreadPriority` for the QEMU ``pid`` (None when the setting or the
    host says no) and why."""
    local = pid is not None and Path(f"/proc/{pid}").exists()
    level, why = priority.plan(nice, local)
    if level is None or pid is None:
        return None, why
    return ThreadPriority(pid, level, vcpu_tids), why
