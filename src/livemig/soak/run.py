"""The soak loop: hop after hop through the combinations, each one written to the ledger.

It stops after ``hops`` hops or ``duration`` seconds (whichever comes first; the hop under
way when the time runs out is finished), on Ctrl-C (the hop under way is aborted, its
source runs on, it is not written), or when the guest is lost. A failed hop whose source
runs on is written and the soak goes on: a failure to converge is data, not an end. The
guest, which livemig booted, is shut down at the end.

``path``: ``lab`` (the lab's ping-pong, :class:`livemig.pingpong.Shuttle`) or ``libvirt``
(a libvirt domain between the testbed's daemons, :class:`LibvirtShuttle`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from livemig.lab.faults import Fault
from livemig.pingpong import Shuttle, ShuttleConfig, hop_line
from livemig.soak import combos, ledger
from livemig.soak.libvirt_shuttle import LibvirtShuttle
from livemig.spec import parse_workload

# A stamped block to flip, chosen from the hop number: a large prime spreads the
# faults over the checker's blocks (faults.pick_stamped takes it modulo their number).
FAULT_STRIDE = 7919


@dataclass(frozen=True)
class SoakOptions:
    names: list[str]
    ledger: Path
    hops: int | None  # hops in this invocation
    duration: float | None  # seconds: no hop starts after it
    inject_every: int | None
    shuttle: ShuttleConfig
    path: str = "lab"  # lab | libvirt


@dataclass
class Outcome:
    hops: int = 0  # written by this invocation
    bad: int = 0  # hops with a mismatch, a lost guest, an uncaught fault
    failed: int = 0  # hops that did not complete (the guest ran on where it was)
    lost: bool = False
    interrupted: bool = False
    first_hop: int = 0
    ok: int = 0
    faults: int = 0
    caught: int = 0


class Soak:
    def __init__(self, opts: SoakOptions, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.shuttle: Shuttle | LibvirtShuttle | None = None
        self.book = ledger.Ledger(opts.ledger)
        self.interrupted = False

    def interrupt(self) -> None:
        self.interrupted = True
        if self.shuttle is not None:
            self.shuttle.interrupt()

    async def run(self) -> Outcome:
        o = self.opts
        st = ledger.state(ledger.read(o.ledger, repair=True))
        out = Outcome(first_hop=st.last_hop + 1)
        since_fault = st.hops_since_fault
        t_end = time.monotonic() + o.duration if o.duration else None
        first = combos.for_hop(o.names, out.first_hop)
        boot = combos.boot_load(first)
        cfg = dataclasses.replace(o.shuttle, workload=boot)
        self.shuttle = LibvirtShuttle(cfg) if o.path == "libvirt" else Shuttle(cfg, prefix="s")
        if self.interrupted:
            return out
        async with self.shuttle.session(self.say) as sh:
            n = out.first_hop
            while not sh.interrupted:
                if o.hops is not None and out.hops >= o.hops:
                    break
                if t_end is not None and time.monotonic() >= t_end:
                    break
                combo = combos.for_hop(o.names, n)
                if sh.running is not None and \
                        sh.workload.text != parse_workload(combo.workload).text:
                    self.say(f"load {combo.load}: {combo.workload}")
                    await sh.set_load(combo.workload)
                kind = combos.fault_due(o.inject_every, since_fault, combo)
                fault = Fault(kind, n * FAULT_STRIDE) if kind else None
                ran = sh.workload.text  # the boot load, when this hop boots the guest
                hop = await sh.hop(n, combo.name, combo.combination(), fault)
                if sh.interrupted and hop.report.get("outcome") == "aborted":
                    self.say(f"interrupted during hop {n}: not written (the guest "
                             f"runs on, on {hop.src})")
                    break
                if kind and not hop.injected and hop.report.get("outcome") != "completed":
                    kind = None  # never reached the paused destination: the next hop has it
                e = ledger.entry(hop, combo, sh.id, kind, ran)
                self.book.append(e)
                out.hops += 1
                since_fault = 0 if kind else since_fault + 1
                problems = ledger.bad(e)
                out.ok += not problems and e["outcome"] == "completed"
                if e["fault"]:
                    out.faults += 1
                    out.caught += bool(e["fault"]["caught"])
                total = out.first_hop - 1 + o.hops if o.hops else None
                self.say(hop_line(hop, total) + f"  [{hop.wall_s:.0f}s; {out.ok}/{out.hops} "
                         f"ok, faults caught {out.caught}/{out.faults}]")
                if e["outcome"] != "completed":
                    out.failed += 1
                if e["mismatches"] or e["guest_lost"] or (e["fault"] and
                                                          not e["fault"]["caught"]):
                    out.bad += 1
                    self.say(f"hop {n}: {'; '.join(problems)} (ledger {o.ledger})")
                if hop.guest_lost:
                    out.lost = True
                    break
                n += 1
        out.interrupted = self.interrupted or sh.interrupted
        return out
