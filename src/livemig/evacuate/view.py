"""The live view of a drain: a line per VM and a host line.

On a terminal the block is redrawn in place each second; otherwise (a log, a pipe)
it is printed whole every ``PLAIN_EVERY_S``. ETA to empty: the running migrations'
longest ETA (remaining ÷ their rate, and what follows a stream: switchover, finish,
confirm, check) plus the plan of what is still queued, with what a migration costs
beyond its bytes as this drain measured it once one has completed.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from livemig.evacuate import schedule
from livemig.units import fmt_bytes

TTY_EVERY_S = 1.0
PLAIN_EVERY_S = 5.0


def vm_line(v: Any, now: float) -> str:
    dst = v.destination.split("//", 1)[-1].split("/", 1)[0]
    head = f"  {v.name:<14} {v.status:<9}"
    if v.status == schedule.MIGRATING:
        lv = v.live
        if lv.get("sent"):
            return f"{head} sent, finishing (resume, confirm, check) -> {dst}"
        if not lv.get("total"):
            return f"{head} setting up -> {dst}, try {v.attempts}"
        eta = lv["remaining"] / lv["bps"] if lv.get("bps") else None
        return (f"{head} round {lv['rounds']}, {fmt_bytes(lv['remaining'])} left, ETA "
                f"{'?' if eta is None else f'{eta:.0f} s'}, cap "
                f"{(v.bandwidth or 0) / 2**20:.0f} MiB/s -> {dst}")
    if v.status == "done":
        return f"{head} verified on {dst} in {(v.ended or 0) - (v.started or 0):.1f} s"
    if v.status in ("failed", "aborted", "skipped"):
        return f"{head} on the source: {v.reason}"
    wait = f", retry in {v.not_before - now:.0f} s" if v.not_before > now else ""
    return f"{head} -> {dst}{wait}"


def vm_eta(v: Any, now: float, overhead: schedule.Overhead) -> float:
    """Seconds until a migrating VM is done: what its stream has left at its rate
    and what follows the stream; a sent one only what is left of that; one not yet
    sending its modelled whole."""
    lv = v.live
    if v.last_byte is not None:
        return max(0.0, overhead.post - (now - float(v.last_byte)))
    if lv.get("sent"):
        return 0.0
    if lv.get("bps"):
        return float(lv["remaining"]) / float(lv["bps"]) + overhead.post
    return schedule.seconds(v.facts, v.bandwidth or 1.0, overhead)


def host_line(vms: list[Any], links: dict[str, float], now: float,
              overhead: schedule.Overhead = schedule.MODELLED) -> str:
    """``overhead``: what a migration costs beyond its bytes (the drain's own once
    one completed)."""
    left = [v for v in vms if v.status in (schedule.QUEUED, schedule.MIGRATING)]
    bytes_left = sum(v.live.get("remaining") or v.facts.nonzero for v in left)
    etas = [vm_eta(v, now, overhead) for v in left if v.status == schedule.MIGRATING]
    queued = [v.facts for v in left if v.status == schedule.QUEUED]
    eta = max(etas, default=0.0) + schedule.simulate(queued, links,
                                                     overhead=overhead).total_s
    return (f"[{now:6.1f}s] host: {len(left)} of {len(vms)} VMs left, "
            f"{fmt_bytes(int(bytes_left))} left, ETA to empty {eta:.0f} s")


class View:
    def __init__(self, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self._last = 0.0
        self._drawn = 0

    def show(self, evac: Any, force: bool = False) -> None:
        if not self.enabled:
            return
        every = TTY_EVERY_S if self.tty else PLAIN_EVERY_S
        if not force and time.monotonic() - self._last < every:
            return
        self._last = time.monotonic()
        now = evac.t()
        lines = [host_line(evac.vms, evac.o.links, now, evac.overhead()),
                 *(vm_line(v, now) for v in evac.vms)]
        if self.tty and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn = len(lines) if self.tty else 0
