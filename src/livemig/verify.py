"""``livemig verify``: one guest migrated back and forth between the testbed's hosts.

Every migration (hop) uses the next feature combination, runs the host's exact RAM
comparison (and the disk image comparison when the disk is copied), while the guest's
stamp-and-verify checker watches its own memory and disk across every hop. With
``--inject KIND`` each hop also corrupts the destination on purpose, and the summary
counts how many of those faults the host comparison and the guest checker named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.lab.faults import Fault
from livemig.pingpong import Combination, Hop, Shuttle, ShuttleConfig, hop_line

DEFAULT_WORKLOAD = ("verify:mem=64M,disk=32M+mem:size=128M,rate=32M,hot=80/10"
                    "+disk:bs=8K,rate=1M")
INJECT_KINDS = ("ram-stamped", "disk-stamped")

COMBINATIONS: dict[str, Combination] = {
    "plain": Combination(),
    "multifd-2": Combination({"multifd-channels": "2"}),
    "multifd-4": Combination({"multifd-channels": "4"}),
    "zstd": Combination({"multifd-compression": "zstd", "multifd-channels": "2"}),
    "lz4": Combination({"multifd-compression": "lz4", "multifd-channels": "2"}),
    "lz4-bypass": Combination({"multifd-compression": "lz4", "multifd-channels": "2",
                               "multifd-compress-bypass-percent": "60"}),
    "hot-page-defer": Combination({"x-hot-page-defer-percent": "30"}, bandwidth=48 << 20),
    "direct-throttle": Combination({"throttle": "direct"}, bandwidth=24 << 20),
    "storage-copy": Combination(storage="copy"),
    "plain-unshaped": Combination(link=None),
    "lz4-unshaped": Combination({"multifd-compression": "lz4", "multifd-channels": "2"},
                                link=None),
}


@dataclass
class VerifyOptions:
    rounds: int
    combinations: list[str]
    memory: int
    workload: str
    qemu: Path
    accel: str
    accel_reason: str
    inject: str | None = None
    max_time: float = 180.0


class PingPong:
    """``livemig verify``: --rounds hops cycling through the combinations."""

    def __init__(self, opts: VerifyOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.shuttle = Shuttle(ShuttleConfig(
            memory=opts.memory, workload=opts.workload, qemu=opts.qemu, accel=opts.accel,
            accel_reason=opts.accel_reason, max_time=opts.max_time))
        self.id = self.shuttle.id
        self.hops: list[Hop] = []

    @property
    def interrupted(self) -> bool:
        return self.shuttle.interrupted

    def interrupt(self) -> None:
        self.shuttle.interrupt()

    async def run(self) -> dict[str, Any]:
        o = self.opts
        async with self.shuttle.session(self.say) as sh:
            names = o.combinations
            if o.inject and o.inject.startswith("disk"):
                names = [n for n in names if COMBINATIONS[n].storage == "copy"]
            for i in range(o.rounds):
                if sh.interrupted:
                    break
                name = names[i % len(names)]
                fault = Fault(o.inject, (i + 1) * 7919) if o.inject else None
                hop = await sh.hop(i + 1, name, COMBINATIONS[name], fault)
                self.hops.append(hop)
                self.say(hop_line(hop, o.rounds))
                if hop.report.get("outcome") != "completed":
                    self.say("stopping: the guest did not move (it runs on where it was)")
                    break
        return self.summary()

    def summary(self) -> dict[str, Any]:
        by: dict[str, dict[str, int]] = {}
        for h in self.hops:
            b = by.setdefault(h.combination, {"migrations": 0, "completed": 0,
                                              "mismatches": 0})
            b["migrations"] += 1
            b["completed"] += h.report.get("outcome") == "completed"
            b["mismatches"] += h.unexplained
        injected = sum(len(h.injected) for h in self.hops)
        by_host = sum(h.detected_by_host for h in self.hops)
        by_guest = sum(h.detected_by_guest for h in self.hops)
        return {
            "run_id": self.id,
            "migrations": len(self.hops),
            "completed": sum(h.report.get("outcome") == "completed" for h in self.hops),
            "mismatches": sum(h.unexplained for h in self.hops),
            "by_combination": by,
            "inject": self.opts.inject,
            "injected": injected,
            # a fault counts as detected when the host comparison named it and, for
            # faults in the checker's blocks, the guest checker named it too
            "detected": sum(min(h.detected_by_host, h.detected_by_guest) for h in self.hops),
            "detected_by_host": by_host,
            "detected_by_guest": by_guest,
            "interrupted": self.interrupted,
            "hops": [h.as_dict() for h in self.hops],
        }

