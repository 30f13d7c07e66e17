"""Thread pinning of a source QEMU on this host, as ``policy.pinning`` plans it.

The plan (migration threads away from the vCPUs) comes from the pure policy; this
module carries it out on the QEMU's threads in ``/proc/PID/task`` and puts every
affinity it changed back afterwards: a VM livemig did not start is never left
pinned. Only the vCPU threads outlive the migration (the migration threads end
with it), so their original affinities are what the guardian is handed, before
anything is pinned, to set back should livemig die.

The vCPU threads are the ones QMP's ``query-cpus-fast`` names (``thread-id``), so a
QEMU started without ``-name debug-threads=on`` (every thread then called
``qemu-system-x86``) still has its vCPUs kept off the migration's CPUs; its migration
threads, unnamed, then run wherever the kernel puts them (the report says which
threads were pinned). A QEMU on another host (its pid not visible here) is not
pinned; the report says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from livemig.policy import pinning
from livemig.policy.pinning import PinPlan

log = logging.getLogger(__name__)

MIGRATION_THREAD_PREFIXES = ("mig/", "live_migration", "multifd")


def is_migration_thread(comm: str) -> bool:
    """QEMU names its migration threads ``live_migration``/``multifdsend_N`` (up to
    9.x) and ``mig/src/main``, ``mig/src/send_N``... (10.x)."""
    return comm.startswith(MIGRATION_THREAD_PREFIXES)


def threads(pid: int) -> dict[int, str]:
    """Thread id → name of a running process (empty if it is gone)."""
    out: dict[int, str] = {}
    try:
        for t in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                out[int(t.name)] = (t / "comm").read_text().strip()
    except OSError:
        pass
    return out


def vcpu_affinities(pid: int, vcpu_tids: Collection[int] | None = None
                    ) -> dict[int, list[int]]:
    """The current affinity of each vCPU thread (``vcpu_tids``, else the threads
    named like vCPUs): what a restore sets back."""
    out: dict[int, list[int]] = {}
    names = threads(pid)
    tids = [t for t in names if t in vcpu_tids] if vcpu_tids is not None else [
        t for t, comm in names.items() if pinning.is_vcpu_thread(comm)]
    for tid in tids:
        with contextlib.suppress(OSError):
            out[tid] = sorted(os.sched_getaffinity(tid))
    return out


def restore_affinities(originals: dict[int, list[int]]) -> list[str]:
    """Set back the affinities in ``originals`` (threads gone are skipped); what was
    done, one line each."""
    done = []
    for tid, cpus in originals.items():
        try:
            if sorted(os.sched_getaffinity(tid)) != sorted(cpus):
                os.sched_setaffinity(tid, cpus)
                done.append(f"thread {tid}: affinity back to CPU {_cpus(cpus)}")
        except OSError:
            continue  # the thread (or the QEMU) is gone
    return done


class ThreadPinner:
    """Pins a local QEMU's vCPU and migration threads (new migration threads appear
    when ``migrate`` starts, so :meth:`apply` runs on every poll) and restores the
    vCPU threads' affinities at the end."""

    def __init__(self, pid: int, plan: PinPlan, mode: str,
                 vcpu_tids: Collection[int] | None = None) -> None:
        self.pid = pid
        self.plan = plan
        self.mode = mode
        self.vcpu_tids = frozenset(vcpu_tids) if vcpu_tids is not None else None
        self.originals = vcpu_affinities(pid, self.vcpu_tids)
        self.pinned: dict[str, list[int]] = {}

    def _is_vcpu(self, tid: int, comm: str) -> bool:
        if self.vcpu_tids is not None:
            return tid in self.vcpu_tids
        return pinning.is_vcpu_thread(comm)

    def apply(self) -> None:
        for tid, comm in threads(self.pid).items():
            key = f"{tid}:{comm}"
            if key in self.pinned:
                continue
            if self._is_vcpu(tid, comm):
                cpus = self.plan.vcpu_cpus
                if tid not in self.originals:  # a vCPU hot-plugged since: keep its own
                    with contextlib.suppress(OSError):
                        self.originals[tid] = sorted(os.sched_getaffinity(tid))
            elif is_migration_thread(comm):
                cpus = self.plan.migration_cpus
            else:
                continue
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError as e:
                log.info("cannot pin %s: %s", key, e)
                continue
            self.pinned[key] = sorted(cpus)

    def restore(self) -> list[str]:
        return restore_affinities(self.originals)

    def as_report(self) -> dict[str, Any]:
        return {"mode": self.mode, "applied": True, "reason": self.plan.reason,
                "threads": dict(self.pinned)}


def plan_for(pid: int | None, vcpus: int, mode: str,
             vcpu_tids: Collection[int] | None = None) -> tuple[ThreadPinner | None, str]:
    """A pinner for the QEMU ``pid`` (None when the policy says no or the QEMU is not
    on this host) and why. The host CPUs are the ones the QEMU may run on;
    ``vcpu_tids``: the vCPU threads as QMP's ``query-cpus-fast`` names them."""
    if mode == "off":
        return None, "pinning off"
    if pid is None or not Path(f"/proc/{pid}").exists():
        return None, "not pinned: the source QEMU is not on this host"
    try:
        cpus = sorted(os.sched_getaffinity(pid))
    except OSError as e:
        return None, f"not pinned: {e}"
    plan, why = pinning.plan(cpus, vcpus, mode)
    if plan is None:
        return None, why
    return ThreadPinner(pid, plan, mode, vcpu_tids), why


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))
