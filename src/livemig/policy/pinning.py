"""Where the source QEMU's threads may run: migration threads away from the vCPUs.

A migration thread that shares a host CPU with a busy vCPU slows both: the stream
stalls when the vCPU runs, and the guest loses time when the stream runs. With a
spare host CPU (more than the vCPUs plus one for QEMU's main loop), the migration
threads get the last CPUs and the vCPUs the first ones. ``on`` pins even without a
spare CPU (as long as there are two), ``off`` never pins.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("off", "auto", "on")


@dataclass(frozen=True)
class PinPlan:
    vcpu_cpus: frozenset[int]
    migration_cpus: frozenset[int]
    reason: str


def plan(host_cpus: list[int], vcpus: int, mode: str) -> tuple[PinPlan | None, str]:
    """The pinning to apply (or None) and why."""
    if mode not in MODES:
        raise ValueError(f"pin must be one of {MODES}")
    n = len(host_cpus)
    if mode == "off":
        return None, "pinning off"
    spare = n - vcpus - 1
    if mode == "auto" and spare < 1:
        return None, (f"not pinned: no spare host CPU ({n} CPUs for {vcpus} vCPU(s) and "
                      "the main loop)")
    if n < 2:
        return None, "not pinned: one host CPU"
    mig = host_cpus[-max(1, min(spare, 2)):]
    rest = [c for c in host_cpus if c not in mig]
    p = PinPlan(frozenset(rest), frozenset(mig),
                f"migration threads on CPU {','.join(map(str, mig))}, vCPUs on CPU "
                f"{','.join(map(str, rest))} ({n} host CPUs, {vcpus} vCPU(s))")
    return p, p.reason


def is_vcpu_thread(comm: str) -> bool:
    return comm.startswith("CPU ") and comm.endswith(("/TCG", "/KVM"))
