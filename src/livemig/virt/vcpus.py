"""A libvirt domain's vCPUs' share of the CPU they ask for
(:mod:`livemig.engine.vcpushare`): from this host's kernel when the domain's QEMU
runs here (:func:`~livemig.virt.sampling.local_threads`: its process and vCPU
threads), else from libvirt's ``vcpu.<n>.time`` and ``vcpu.<n>.delay``
on the domain's own host, else not at all (the daemon reports no ``delay``)."""

from __future__ import annotations

from typing import Any

from livemig.engine.vcpushare import (
    TICKS_ASKED_S,
    Reader,
    VcpuShare,
    libvirt_counters,
    schedstat_reader,
)
from livemig.virt.conn import libvirt_module
from livemig.virt.sampling import local_threads


def domain_stats_reader(conn: Any, dom: Any) -> Reader:
    libvirt = libvirt_module()

    def read() -> tuple[int, int] | None:
        try:
            recs = conn.domainListGetStats([dom], libvirt.VIR_DOMAIN_STATS_VCPU)
        except (libvirt.libvirtError, AttributeError):
            return None
        return libvirt_counters(dict(recs[0][1])) if recs else None
    return read


def vcpu_share(conn: Any, dom: Any) -> tuple[VcpuShare | None, str]:
    """The meter, and where it reads (or why there is none)."""
    local = local_threads(dom)
    if local is not None:
        pid, tids = local
        meter = VcpuShare(schedstat_reader(pid, tids))
        if meter.reading:
            return meter, f"this host's scheduler statistics of QEMU {pid}'s vCPU threads"
    meter = VcpuShare(domain_stats_reader(conn, dom), TICKS_ASKED_S)
    if meter.reading:
        return meter, "libvirt's vcpu.<n>.time and vcpu.<n>.delay"
    return None, ("the QEMU is not on this host and libvirt reports no vcpu.<n>.delay "
                  "(its run-queue wait)")
