"""What an evacuation did to its guests, read from outside (the benchmark's observer).

Every domain of the testbed's fleet carries livemig's agent on a virtio-serial
channel (``testfleet``). The observer connects to each domain's channel on the
source as soon as it is defined, and on the destinations as soon as libvirt starts
the incoming QEMU there (one poll per host, not per domain), and keeps the agent's
heartbeats and work counters across the hosts. From them, per VM and on the same
clock for every configuration: the normal rate (from the agent's ``ready`` to the
evacuation's start), and over the evacuation (its start to its end plus a settle):
the guest work lost (∫ 1 − rate/normal), the seconds below 10 % and 50 % of normal,
and the longest heartbeat gap (the guest-visible pause, switchover included).

This is the benchmark's measure, not ``livemig evacuate``'s: a user's VMs have no
agent, and the evacuation's own report keeps what QEMU and libvirt say.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from livemig import libvirt_lab, metrics
from livemig.errors import VMError
from livemig.lab.agent import AgentLink

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a destination host is asked which fleet domains it has
CONNECT_S = 10.0  # how long a channel that libvirt named may take to accept
SETTLE_S = 2.0  # after the evacuation's end: the last guests' first beats on arrival


class FleetWatch:
    """The agents of ``names`` on every host they are seen on, for the whole run."""

    def __init__(self, names: list[str], destinations: tuple[str, ...] = ("dst", "dst2")) -> None:
        self.names = list(names)
        self.destinations = destinations
        self.links: dict[str, list[AgentLink]] = {n: [] for n in names}
        self.ready_at: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Connect to every domain's agent on src (they were just started)."""
        c = await asyncio.to_thread(libvirt_lab.conn, "src")
        try:
            for n in self.names:
                dom = await asyncio.to_thread(c.lookupByName, n)
                path = libvirt_lab.channel_path(await asyncio.to_thread(dom.XMLDesc, 0))
                a = await libvirt_lab.connect_agent("src", path, 60.0)
                self.links[n].append(a)
                self._tasks.append(asyncio.create_task(self._ready(n, a)))
        finally:
            c.close()

    async def _ready(self, name: str, a: AgentLink) -> None:
        await a.ready.wait()
        self.ready_at.setdefault(name, time.time())

    async def wait_ready(self, timeout: float) -> None:
        """Until every agent said ``ready`` (memory filled, workload running)."""
        deadline = time.monotonic() + timeout
        while len(self.ready_at) < len(self.names):
            if time.monotonic() > deadline:
                missing = sorted(set(self.names) - set(self.ready_at))
                raise VMError(f"the guest agent never said ready in {', '.join(missing)}")
            await asyncio.sleep(0.2)

    def follow(self) -> None:
        """From now on, connect to each domain's agent on a destination when it appears."""
        for side in self.destinations:
            self._tasks.append(asyncio.create_task(self._follow(side)))

    async def _follow(self, side: str) -> None:
        from livemig.virt.conn import libvirt_module

        libvirt = libvirt_module()
        c = await asyncio.to_thread(libvirt_lab.conn, side)
        seen: set[str] = set()
        try:
            while len(seen) < len(self.names):
                doms = await asyncio.to_thread(c.listAllDomains)
                for d in doms:
                    n = d.name()
                    if n not in self.links or n in seen:
                        continue
                    try:
                        path = libvirt_lab.channel_path(await asyncio.to_thread(d.XMLDesc, 0))
                        a = await libvirt_lab.connect_agent(side, path, CONNECT_S)
                    except (libvirt.libvirtError, VMError) as e:
                        log.debug("%s on %s: not yet (%s)", n, side, e)
                        continue
                    seen.add(n)
                    self.links[n].append(a)
                await asyncio.sleep(POLL_S)
        finally:
            c.close()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for links in self.links.values():
            for a in links:
                with contextlib.suppress(Exception):
                    await a.close()

    def vm(self, name: str, start: float, end: float) -> dict[str, Any]:
        """One VM's harm over [start, end] against its normal rate before ``start``."""
        links = self.links[name]
        rates = sorted((s for a in links for s in a.rates), key=lambda s: s.t)
        base_from = self.ready_at.get(name, start - 5.0)
        st = metrics.workload_stats(rates, base_from, start, end)
        beats = sorted(b for a in links for b in a.heartbeats)
        gap = metrics.longest_gap(beats, start, end)
        # the rate over the window (s from its start, bytes/s), to see where work went
        series = [[round(t - start, 2), round(r)]
                  for t, r in metrics.rate_series(rates, start, end)]
        net = net_lost({"baseline_rate": st.baseline_rate, "series": series})
        return {**st.as_dict(), "work_lost_net_s": net, "hosts": [a.name for a in links],
                "guest_pause_ms": None if gap is None else round(gap.seconds * 1000.0, 1),
                "series": series}

    def summary(self, start: float, end: float) -> dict[str, Any]:
        """Every VM's harm and the fleet's: work lost summed and worst, the worst time
        below 10 %, the longest guest-visible pause."""
        vms = {n: self.vm(n, start, end + SETTLE_S) for n in self.names}
        return {"window_s": round(end + SETTLE_S - start, 3), "vms": vms, **totals(vms)}


def totals(vms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fleet's figures from its VMs' (a VM with no figure is left out of each)."""
    def have(key: str) -> list[float]:
        return [float(v[key]) for v in vms.values() if v.get(key) is not None]

    lost, below10, pauses = have("work_lost_s"), have("seconds_below_10pct"), \
        have("guest_pause_ms")
    nets = [x for x in map(net_lost, vms.values()) if x is not None]
    return {"work_lost_sum_s": round(sum(lost), 3) if lost else None,
            "work_lost_net_sum_s": round(sum(nets), 3) if nets else None,
            "work_lost_worst_s": max(lost, default=None),
            "below_10pct_worst_s": max(below10, default=None),
            "guest_pause_worst_ms": max(pauses, default=None),
            "measured": len(lost)}


def net_lost(vm: dict[str, Any]) -> float | None:
    """A VM's work lost without the clipping (:func:`metrics.work_lost_net`), from its
    figures, or from its rate series and normal rate in a run recorded before the
    figure was kept."""
    if vm.get("work_lost_net_s") is not None:
        return float(vm["work_lost_net_s"])
    normal, series = vm.get("baseline_rate"), vm.get("series")
    if not normal or not series:
        return None
    return round(metrics.work_lost_net([float(r) for _, r in series], float(normal)), 3)


def split(vms: dict[str, dict[str, Any]], records: list[dict[str, Any]],
          offset: float) -> dict[str, float]:
    """The fleet's work lost (∫ 1 − rate/normal, per 100 ms bin, clipped at 0 like
    :func:`metrics.work_lost`) split by where each VM was in its own migration:
    ``before`` it started, ``during`` (its start to its end on the evacuation's
    clock), ``after`` it ended. ``vms``: :meth:`FleetWatch.summary`'s per-VM figures
    with their ``series``; ``records``: the evacuation report's ``vms`` (``start_s``,
    ``end_s``, ``stream_s``); ``offset``: seconds from the harm window's start to the
    drain's. ``during`` is also split where the record has its stream: ``starting``
    (before its first byte: the child's start, libvirt's prepare starting the
    destination QEMU), ``streaming`` (first to last byte) and ``finishing`` (from the
    switchover: the guest paused until libvirt's finish resumes it on the
    destination, then the confirm and the RAM check). On one
    machine shared by the source and the destinations (the testbed), what a VM loses
    outside its stream is contention for the host's CPUs with the other VMs'
    migrations and destination QEMUs, which separate hosts would not have."""
    out = {"before": 0.0, "during": 0.0, "after": 0.0}
    parts = {"starting": 0.0, "streaming": 0.0, "finishing": 0.0}
    streams = 0
    for r in records:
        v = vms.get(str(r.get("name")), {})
        normal, series = v.get("baseline_rate"), v.get("series")
        start, end = r.get("start_s"), r.get("end_s")
        if not normal or not series or start is None or end is None:
            continue
        first, last = r.get("stream_s") or (None, None)
        streams += first is not None
        for t, rate in series:
            lost = max(0.0, 1.0 - float(rate) / float(normal)) * metrics.BIN_S
            at = float(t) - offset
            where = "before" if at < start else "during" if at < end else "after"
            out[where] += lost
            if where == "during" and first is not None and last is not None:
                parts["starting" if at < first else "streaming" if at < last
                      else "finishing"] += lost
    if streams:
        out.update(parts)
    return {k: round(v, 3) for k, v in out.items()}
