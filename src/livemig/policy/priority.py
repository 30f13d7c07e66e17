"""Which of the source QEMU's threads run below its vCPUs while the migration lasts.

A host with no spare CPU splits its CPUs among the runnable threads by their weight.
While the migration runs, the source QEMU has its vCPUs plus the migration's threads
(the migration thread, one per multifd channel compressing pages, the return path),
all at the same weight: a 1-vCPU guest on 2 host CPUs whose two zstd channels are
busy shares them three ways, and the guest runs at two thirds of its speed, at half
when a third thread (the destination on the same host, livemig itself) wakes too. A
nice value above 0 on the migration's threads gives the vCPUs the CPUs first, and
the migration threads still get every CPU the vCPUs leave idle (nice changes a
thread's weight, not what it may use): on a host with a spare CPU nothing changes.
The share the migration keeps under contention is its weight's: nice 5 weighs 335
against a vCPU's 1024, nice 10 weighs 110.

The threads are the ones the migration created: those QEMU names as migration threads
(``mig/src/main``, ``mig/src/send_N``..., with ``-name debug-threads=on``, which
libvirt always passes); in a QEMU that names no threads, those that appeared after
``migrate`` and are not vCPUs. Named migration threads end with the migration; the
unnamed ones may include a worker of QEMU's thread pool that outlives it, so their
nice value is put back at the end.
"""

from __future__ import annotations

from collections.abc import Collection

from livemig.policy.pinning import is_migration_thread

MIN_NICE = 0
MAX_NICE = 19


def lowered(tid: int, comm: str, process_comm: str, before: Collection[int],
            vcpus: Collection[int]) -> bool:
    """Whether thread ``tid`` (named ``comm``) of a QEMU whose main thread is named
    ``process_comm`` is one of the migration's: named as one, or, in a QEMU that names
    no threads (``comm`` is the process's own name), new since ``before`` (the threads
    just before ``migrate``) and not a vCPU."""
    if tid in vcpus:
        return False
    if is_migration_thread(comm):
        return True
    return comm == process_comm and tid not in before


def plan(nice: int, local: bool) -> tuple[int | None, str]:
    """The nice value to give the migration's threads (None: none) and why."""
    if not MIN_NICE <= nice <= MAX_NICE:
        raise ValueError(f"migration-nice must be {MIN_NICE} to {MAX_NICE}")
    if nice == MIN_NICE:
        return None, "migration threads at the vCPUs' priority (migration-nice 0)"
    if not local:
        return None, ("migration threads not lowered: the source QEMU is not a process "
                      "on this host")
    return nice, (f"migration threads at nice {nice}: the vCPUs get the host's CPUs "
                  "first, the migration every CPU they leave idle")
