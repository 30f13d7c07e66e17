"""Which VMs of a host to migrate when, and how much of the link each one gets.

Pure: :func:`decide` turns a :class:`Snapshot` of the evacuation (each VM's facts and
state, the links) into :class:`Start` / :class:`SetBandwidth` actions, like the
migration policies in :mod:`livemig.policy`; :func:`simulate` runs ``decide`` against
the encoding model (:func:`livemig.policy.encoding.estimate`) to give the plan's
expected times (``--dry-run``) without a VM. docs/evacuate.md says why the rule is
right.

The rule, per link (a destination path; all destinations share one link unless the
operator says they have their own):

- a VM's *reserve* is the wire bandwidth at which its re-send rounds shrink by
  ``MAX_Q`` each on their own (dirty rate ÷ (``MAX_Q`` × delta ratio)), with
  ``HEADROOM``, never below ``MIN_SHARE`` of the link;
- a VM whose reserve exceeds the whole link is *heavy*: it needs a throttle even
  alone, so it runs alone on its link with all of it (sharing would only deepen and
  lengthen its throttle: guest harm) and nothing starts beside it;
- the queue is sorted light before heavy, then by reserve, then by the time alone
  (shortest first: VMs leave the host soonest, the count of VMs left drops fastest);
- queued VMs start in that order on each link, without overtaking (no starvation),
  while the reserves of the running ones plus its own fit in the link and fewer than
  ``max_parallel`` migrations run; the links take turns, least busy first;
- the running VMs share the link in proportion to their remaining wire bytes (so
  that a wave ends together and the link stays full), none below its reserve;
  a VM measured busier than planned gets its new reserve at once (re-plan), taken
  from the others' spare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from livemig.policy.encoding import MAX_Q, Codec, Context, Estimate, estimate

# a VM's reserve is this much above what keeps its rounds shrinking by MAX_Q: the
# dirty rate measured before the migration is a 1-2 s sample and wanders
HEADROOM = 1.25
# every migration gets at least this share of its link: a VM that dirties nothing
# still has its first pass to send, and a cap near 0 would stall it
MIN_SHARE = 0.05
# seconds a migration costs beyond moving bytes: the child livemig's start and page
# sample (~1 s), libvirt's prepare on the destination (a QEMU started under TCG: ~5 s
# from "migration started" to the first RAM round with 3 at once on this 2-core
# testbed), the switchover, confirm and the RAM check (~1.5 s): 8 s measured per
# 128 MiB domain (tests/testbed/test_evacuate_vm.py). It is what running light VMs
# in parallel saves.
OVERHEAD_S = 8.0
# bandwidth changes smaller than this share are not sent (libvirt's cap is whole
# MiB/s and each change is a call to the source daemon)
CHANGE = 0.10
# bytes/s one migration thread encodes: high enough that the link decides here (the
# CPU side is the encoding model's business, once the VM's migration runs)
ENCODE_SPEED = 1e12
QUEUED, MIGRATING, DONE, FAILED = "queued", "migrating", "done", "failed"
SHARED_LINK = "link"


@dataclass(frozen=True)
class VmFacts:
    """What the fleet measurement found (bytes, bytes/s)."""

    name: str
    ram: int
    nonzero: float  # guest bytes the first pass sends as data (zero pages are ~free)
    dirty_rate: float  # distinct guest bytes dirtied per second
    ratio: float = 1.0  # first pass: guest bytes ÷ wire bytes (compressibility)
    resend_ratio: float = 1.0  # re-sent pages: guest bytes ÷ wire bytes (deltas)
    link: str = SHARED_LINK  # the link (destination path) its stream crosses


@dataclass(frozen=True)
class VmState:
    facts: VmFacts
    status: str = QUEUED
    bandwidth: float | None = None  # the cap it runs with (migrating)
    progress: float = 0.0  # share of its migration done (0..1), for the simulation


@dataclass(frozen=True)
class Snapshot:
    t: float
    vms: tuple[VmState, ...]
    links: dict[str, float]  # bytes/s per link
    max_parallel: int = 3


@dataclass(frozen=True)
class Action:
    name: str
    bandwidth: float  # bytes/s
    reason: str


@dataclass(frozen=True)
class Start(Action):
    pass


@dataclass(frozen=True)
class SetBandwidth(Action):
    pass


def reserve(f: VmFacts, link: float) -> float:
    """Wire bytes/s at which ``f``'s rounds shrink on their own (with headroom)."""
    need = f.dirty_rate / (MAX_Q * f.resend_ratio) * HEADROOM
    return max(need, MIN_SHARE * link)


def heavy(f: VmFacts, link: float) -> bool:
    """Needs a throttle even with the whole link to itself."""
    return f.dirty_rate / (MAX_Q * f.resend_ratio) > link


def seconds(f: VmFacts, bandwidth: float) -> float:
    """Modelled migration time at ``bandwidth`` wire bytes/s, overhead included."""
    return OVERHEAD_S + _estimate(f, bandwidth).seconds


def work_lost(f: VmFacts, bandwidth: float) -> float:
    """Seconds of guest work a throttle takes to make it converge at ``bandwidth``."""
    return _estimate(f, bandwidth).work_lost


def _estimate(f: VmFacts, bandwidth: float) -> Estimate:
    first = Codec(f.ratio, ENCODE_SPEED)
    resend = Codec(f.resend_ratio, ENCODE_SPEED)
    return estimate(first, resend, max(f.nonzero, 1.0), f.dirty_rate,
                    Context(link_rate=max(bandwidth, 1.0), cpus=1.0, guest_ram=f.ram))


def order_key(f: VmFacts, link: float) -> tuple[bool, float, float, str]:
    return (heavy(f, link), reserve(f, link), seconds(f, link), f.name)


def decide(s: Snapshot) -> list[Action]:
    """What to start and which caps to change now."""
    running = [v for v in s.vms if v.status == MIGRATING]
    mine = {ln: [v for v in running if v.facts.link == ln] for ln in s.links}
    queues = {ln: sorted((v for v in s.vms if v.status == QUEUED and v.facts.link == ln),
                         key=lambda v: order_key(v.facts, s.links[v.facts.link]))
              for ln in s.links}
    starting: dict[str, list[VmState]] = {ln: [] for ln in s.links}
    used = {ln: sum(reserve(v.facts, s.links[ln]) for v in mine[ln]) for ln in s.links}
    blocked = {ln for ln in s.links if any(heavy(v.facts, s.links[ln]) for v in mine[ln])}
    active = len(running)
    # the links take turns (the least busy link's head first, then the best head), so
    # that one link's queue does not fill max_parallel while another link idles
    while active < s.max_parallel:
        heads = [(len(mine[ln]) + len(starting[ln]),
                  order_key(queues[ln][0].facts, s.links[ln]), ln) for ln in s.links
                 if queues[ln] and ln not in blocked]
        if not heads:
            break
        _, _, ln = min(heads)
        link, v = s.links[ln], queues[ln].pop(0)
        if heavy(v.facts, link):
            if not mine[ln] and not starting[ln]:
                starting[ln].append(v)
                active += 1
            blocked.add(ln)  # a heavy VM runs alone: nothing after it starts beside it
            continue
        r = reserve(v.facts, link)
        if used[ln] + r > link:
            blocked.add(ln)  # no overtaking: the next one waits for room
            continue
        starting[ln].append(v)
        used[ln] += r
        active += 1
    out: list[Action] = []
    for ln, link in s.links.items():
        group = mine[ln] + starting[ln]
        shares = split(link, [v.facts for v in group],
                       {v.facts.name: _remaining_wire(v) for v in group})
        for v in mine[ln]:
            new = shares[v.facts.name]
            if v.bandwidth is None or abs(new - v.bandwidth) > CHANGE * v.bandwidth:
                out.append(SetBandwidth(v.facts.name, new, _why(v.facts, new, link, len(group))))
        for v in starting[ln]:
            bw = shares[v.facts.name]
            out.append(Start(v.facts.name, bw, _why(v.facts, bw, link, len(group))))
    return out


def split(link: float, vms: list[VmFacts], remaining: dict[str, float]) -> dict[str, float]:
    """The link in proportion to each VM's remaining wire bytes (so that they end
    together and the link stays full), but never below a VM's reserve (water-filling:
    a VM held at its reserve, the rest shared by the others in proportion). A heavy
    VM among others (it turned busy while they ran) gets all but their reserves."""
    if not vms:
        return {}
    if len(vms) == 1:
        return {vms[0].name: link}
    res = {f.name: reserve(f, link) for f in vms}
    hv = [f for f in vms if heavy(f, link)]
    if hv:  # two heavy on one link only happen by re-plan: they split the rest evenly
        heavy_names = {f.name for f in hv}
        others = sum(r for n, r in res.items() if n not in heavy_names)
        if others >= link / 2:  # the others' reserves would starve it: even split
            return {f.name: link / len(vms) for f in vms}
        return {n: (link - others) / len(hv) if n in heavy_names else r
                for n, r in res.items()}
    total_res = sum(res.values())
    if total_res >= link:
        return {n: link * r / total_res for n, r in res.items()}
    weight = {n: max(remaining.get(n, 0.0), 1.0) for n in res}
    held: dict[str, float] = {}
    while True:
        free = link - sum(held.values())
        rest = [n for n in res if n not in held]
        wsum = sum(weight[n] for n in rest)
        out = {n: free * weight[n] / wsum for n in rest}
        low = [n for n in rest if out[n] < res[n]]
        if not low:
            return {**held, **out}
        for n in low:
            held[n] = res[n]


def _remaining_wire(v: VmState) -> float:
    return (1.0 - v.progress) * v.facts.nonzero / v.facts.ratio


def _why(f: VmFacts, bw: float, link: float, n: int) -> str:
    kind = "heavy (throttled even alone)" if heavy(f, link) else (
        "busy" if f.dirty_rate > 0.1 * MAX_Q * link else "idle")
    return (f"{kind}: dirty {f.dirty_rate / 2**20:.1f} MiB/s, reserve "
            f"{reserve(f, link) / 2**20:.1f} MiB/s; {100 * bw / link:.0f}% of the link "
            f"with {n} migrating")


@dataclass
class Planned:
    """One VM in a simulated plan."""

    name: str
    start: float
    end: float
    work_lost: float
    wave: int  # how many ran at its start (itself included)
    bandwidths: list[float] = field(default_factory=list)


@dataclass
class Plan:
    vms: list[Planned]

    @property
    def total_s(self) -> float:
        return max((p.end for p in self.vms), default=0.0)

    @property
    def work_lost(self) -> float:
        return sum(p.work_lost for p in self.vms)

    def order(self) -> list[str]:
        return [p.name for p in sorted(self.vms, key=lambda p: (p.start, p.name))]

    def overlap(self, a: str, b: str) -> bool:
        pa, pb = self.by_name(a), self.by_name(b)
        return pa.start < pb.end - 1e-9 and pb.start < pa.end - 1e-9

    def by_name(self, name: str) -> Planned:
        return next(p for p in self.vms if p.name == name)

    def max_parallel(self) -> int:
        return max((sum(1 for q in self.vms if q.start <= p.start < q.end)
                    for p in self.vms), default=0)


def simulate(fleet: list[VmFacts], links: dict[str, float], max_parallel: int = 3,
             policy: Callable[[Snapshot], list[Action]] | None = None) -> Plan:
    """Run ``decide`` (or ``policy(snapshot)``) against the model: each migration
    progresses at 1 ÷ its modelled time at its current cap; caps change at events."""
    choose = policy or decide
    states = {f.name: VmState(f) for f in fleet}
    planned: dict[str, Planned] = {}
    t = 0.0
    for _ in range(10 * len(fleet) + 10):
        acts = choose(Snapshot(t, tuple(states.values()), links, max_parallel))
        for a in acts:
            v = states[a.name]
            states[a.name] = replace(v, status=MIGRATING, bandwidth=a.bandwidth)
            if isinstance(a, Start):
                n = sum(1 for x in states.values() if x.status == MIGRATING)
                planned[a.name] = Planned(a.name, t, t, 0.0, n)
            planned[a.name].bandwidths.append(a.bandwidth)
        running = [v for v in states.values() if v.status == MIGRATING]
        if not running:
            break
        left = {v.facts.name: (1.0 - v.progress) * seconds(v.facts, v.bandwidth or 1.0)
                for v in running}
        dt = min(left.values())
        t += dt
        for v in running:
            name = v.facts.name
            total = seconds(v.facts, v.bandwidth or 1.0)
            planned[name].work_lost += dt / total * work_lost(v.facts, v.bandwidth or 1.0)
            if left[name] <= dt + 1e-9:
                states[name] = replace(v, status=DONE, progress=1.0)
                planned[name].end = t
            else:
                states[name] = replace(v, progress=v.progress + dt / total)
    return Plan(sorted(planned.values(), key=lambda p: (p.start, p.name)))


def fixed(concurrency: int) -> Callable[[Snapshot], list[Action]]:
    """A fixed-concurrency baseline (Nova: 1, KubeVirt: 2 per node): the queue in the
    given order, ``concurrency`` at a time, TCP's even split of the link."""
    def policy(s: Snapshot) -> list[Action]:
        running = [v for v in s.vms if v.status == MIGRATING]
        queued = [v for v in s.vms if v.status == QUEUED]
        starting = queued[:max(0, concurrency - len(running))]
        out: list[Action] = []
        for link_name, link in s.links.items():
            mine = [v for v in running + starting if v.facts.link == link_name]
            for v in mine:
                bw = link / len(mine)
                if v in starting:
                    out.append(Start(v.facts.name, bw, f"fixed concurrency {concurrency}"))
                elif v.bandwidth != bw:
                    out.append(SetBandwidth(v.facts.name, bw, "even split"))
        return out
    return policy
