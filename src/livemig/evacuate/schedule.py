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
  ``max_parallel`` migrations start or send (one that has sent everything is only
  finishing and counts for neither); an idle link always starts its head (a reserve
  above the whole link, not heavy: it runs alone); the links take turns, least busy
  first; a stream expected to end within ``ENDING_S`` (what a start costs before its
  first byte) holds no room and is not capped, so the next start overlaps its tail;
- on a source host without an idle CPU, one stream holds each link at a time
  (:func:`streams_per_link`: streams side by side keep their guests under migration
  longer for the same time to empty);
- caps are upper limits, under which TCP shares the link evenly (:func:`effective`:
  each stream gets the lesser of its cap and the even level of what is left). A cap
  below the link is set only where that even split would starve a VM of its reserve
  (:func:`split`): a VM that converges at its even share runs uncapped, so a stream
  that ends early or runs CPU-bound (TCG) leaves its part to the others at once
  instead of idling behind a fixed share; a VM measured busier than planned gets its
  new reserve at once (re-plan); a VM whose stream has ended (the migration only
  finishing: resume, confirm, check) no longer counts on its link.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from livemig.errors import LivemigError
from livemig.policy.encoding import MAX_Q, Codec, Context, Estimate, estimate

# a VM's reserve is this much above what keeps its rounds shrinking by MAX_Q: the
# dirty rate measured before the migration is a 1-2 s sample and wanders
HEADROOM = 1.25
# every migration gets at least this share of its link: a VM that dirties nothing
# still has its first pass to send, and a cap near 0 would stall it
MIN_SHARE = 0.05
# seconds a migration costs beyond moving bytes: the child livemig's start (1.8 s
# median with 5 at once on this 2-core testbed; its page sample is the
# evacuation's, reused), libvirt's prepare on the destination (a QEMU started under
# TCG), the switchover, libvirt's finish and confirm with the RAM check (2.3-2.8 s
# median): 8 s measured per 128 MiB domain (tests/testbed/test_evacuate_vm.py,
# docs/results/evacuate-2026-11-25.md). It is what running light VMs in parallel
# saves.
OVERHEAD_S = 8.0
# the part of it before the stream starts (child start, prepare, libvirt's setup);
# the rest comes after the last byte (switchover, finish, confirm, check). Medians
# per VM of the 11-24 and 11-25 benchmarks: 2.0-2.5 s before, 2.4-2.9 s after
# (docs/results/evacuate-2026-11-25.md): about 45 % before. Neither part uses the
# link, which the plan's model (simulate) counts: the others' streams have it then.
PRE_SHARE = 0.45
# a stream expected to end within this many seconds is *ending*: it no longer holds
# room on its link for what waits, so the next VM's child start, prepare and
# libvirt's setup (the part of OVERHEAD_S before its stream, which uses no link)
# overlap that tail instead of following it. On the busy fleet of 2026-11-25 a
# heavy VM waited for the last stream on its link to end, then spent 2.5 s before
# its first byte with that link idle (that run's write-up was lost; the fleet is
# measured in docs/results/evacuate-2026-11-27.md).
ENDING_S = PRE_SHARE * OVERHEAD_S
# idle CPUs (cores' worth) below which the source host has none to spare for the
# migrations' streams: they share the guests' CPUs (streams_per_link)
IDLE_CPU = 1.0
# bandwidth changes smaller than this share are not sent (libvirt's cap is whole
# MiB/s and each change is a call to the source daemon)
CHANGE = 0.10
# bytes/s one migration thread encodes: high enough that the link decides here (the
# CPU side is the encoding model's business, once the VM's migration runs)
ENCODE_SPEED = 1e12
QUEUED, MIGRATING, DONE, FAILED = "queued", "migrating", "done", "failed"
SHARED_LINK = "link"


@dataclass(frozen=True)
class Overhead:
    """Seconds a migration costs beyond moving bytes: before its stream starts
    (``pre``) and after its last byte (``post``). The model's until the drain has
    measured its own (:meth:`livemig.evacuate.run.Evacuation.overhead`): 3.5 s in all
    on the 2026-11-28 machine against the 8 s of 11-25's."""

    pre: float = PRE_SHARE * OVERHEAD_S
    post: float = (1.0 - PRE_SHARE) * OVERHEAD_S

    @property
    def total(self) -> float:
        return self.pre + self.post


MODELLED = Overhead()


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
    sending: bool = True  # migrating and its stream not yet ended (it uses the link)
    # seconds its stream is expected to go on (None: not known yet, e.g. first pass)
    tail_s: float | None = None

    @property
    def ending(self) -> bool:
        """Sending, and its stream ends within ``ENDING_S``."""
        return self.sending and self.tail_s is not None and self.tail_s <= ENDING_S


@dataclass(frozen=True)
class Snapshot:
    t: float
    vms: tuple[VmState, ...]
    links: dict[str, float]  # bytes/s per link
    max_parallel: int = 3
    # streams that hold each link at once (None: as many as the reserves allow); 1
    # on a source host without an idle CPU (:func:`streams_per_link`)
    per_link: int | None = None


@dataclass(frozen=True)
class Action:
    name: str
    bandwidth: float  # bytes/s: the cap (the link's rate: no cap below it)
    reason: str
    expected: float = 0.0  # bytes/s it should get beside the others (0: the cap)


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


def streams_per_link(spare_cpus: float | None) -> int | None:
    """How many streams each link carries at once, from the source host's idle CPUs
    (the node's CPU counters over half a second before the samples, or its CPUs less
    what its domains used where the daemon has no counters; None: not measured, no
    limit).

    A migration slows its guest while it runs (dirty tracking: under TCG every first
    write to a page after a sync takes QEMU's slow path; under KVM a write fault) and
    its encoding takes CPU on the source. Streams sharing a link each last as long as
    all of them together (n streams of B bytes on a link of L: each ≈ n·B/L), so they
    keep n times the VM-seconds under migration that streams one after the other do
    (B/L each), for the same time to empty the link. Where the host has an idle CPU,
    streams side by side cost the guests little and overlap what one cannot (a
    CPU-bound stream, the fixed costs around it), so the reserves decide. Where it has
    none, every CPU-second the migrations take is the guests': one stream at a time per
    link, the next VM's start overlapping the tail of the one before (``ENDING_S``). On
    the busy fleet of 2026-11-28 (docs/results/evacuate-2026-11-28.md, sets i-j) the
    domains used all but 0.5-1.1 of the two CPUs; four streams at once lost 27.5 s
    of guest work (median of 5) where fixed:2 lost 16.9 s, one per link 21.1 s."""
    if spare_cpus is None or spare_cpus >= IDLE_CPU:
        return None
    return 1


def seconds(f: VmFacts, bandwidth: float, overhead: Overhead = MODELLED) -> float:
    """Modelled migration time at ``bandwidth`` wire bytes/s, overhead included."""
    return overhead.total + _estimate(f, bandwidth).seconds


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
    # a migration whose stream has ended is only finishing (the destination runs the
    # guest; libvirt's confirm, the check and the report are left): off its link and
    # out of max_parallel, so the next one's start overlaps that finish
    mine = {ln: [v for v in running if v.facts.link == ln and v.sending] for ln in s.links}
    # room on a link is what the streams that are not ending leave (an ending one
    # keeps its share of the link until it ends: it stays in the caps below)
    holding = {ln: [v for v in vs if not v.ending] for ln, vs in mine.items()}
    queues = {ln: sorted((v for v in s.vms if v.status == QUEUED and v.facts.link == ln),
                         key=lambda v: order_key(v.facts, s.links[v.facts.link]))
              for ln in s.links}
    starting: dict[str, list[VmState]] = {ln: [] for ln in s.links}
    used = {ln: sum(reserve(v.facts, s.links[ln]) for v in holding[ln]) for ln in s.links}
    blocked = {ln for ln in s.links if any(heavy(v.facts, s.links[ln]) for v in holding[ln])}
    active = sum(1 for v in running if v.sending)
    # the links take turns (the least busy link's head first, then the best head), so
    # that one link's queue does not fill max_parallel while another link idles
    while active < s.max_parallel:
        heads = [(len(holding[ln]) + len(starting[ln]),
                  order_key(queues[ln][0].facts, s.links[ln]), ln) for ln in s.links
                 if queues[ln] and ln not in blocked]
        if not heads:
            break
        _, _, ln = min(heads)
        if s.per_link is not None and len(holding[ln]) + len(starting[ln]) >= s.per_link:
            blocked.add(ln)  # the host's CPUs: its next stream waits for this one's tail
            continue
        link, v = s.links[ln], queues[ln].pop(0)
        if heavy(v.facts, link):
            if not holding[ln] and not starting[ln]:
                starting[ln].append(v)
                active += 1
            blocked.add(ln)  # a heavy VM runs alone: nothing after it starts beside it
            continue
        r = reserve(v.facts, link)
        if used[ln] + r > link:
            blocked.add(ln)  # no overtaking: the next one waits for room
            if holding[ln] or starting[ln]:
                continue
            # its reserve (with HEADROOM) is above the whole link, yet it converges
            # alone: it runs alone, like a heavy one, or it would wait for ever
        starting[ln].append(v)
        used[ln] += r
        active += 1
    out: list[Action] = []
    for ln, link in s.links.items():
        group = mine[ln] + starting[ln]
        # an ending stream is not capped: what starts beside it sends nothing for
        # its first ENDING_S (child start, prepare), and the tail should be done by then
        caps = split(link, [v.facts for v in holding[ln] + starting[ln]])
        ending = {v.facts.name for v in mine[ln] if v.ending}
        # a start's first byte comes after the ending streams' last (that is what
        # ending means): it expects its share of the link without them, the rate its
        # child's encoding model plans with (--set link-rate)
        after = effective(link, {n: c for n, c in caps.items() if n not in ending})
        caps.update({n: link for n in ending})
        gets = effective(link, caps)
        for v in mine[ln]:
            new = caps[v.facts.name]
            if v.bandwidth is None or abs(new - v.bandwidth) > CHANGE * v.bandwidth:
                out.append(SetBandwidth(v.facts.name, new,
                                        _why(v.facts, new, gets[v.facts.name], link,
                                             len(group)), gets[v.facts.name]))
        for v in starting[ln]:
            bw, rate = caps[v.facts.name], after[v.facts.name]
            out.append(Start(v.facts.name, bw, _why(v.facts, bw, rate, link,
                                                    len(group) - len(ending)), rate))
    return out


def split(link: float, vms: list[VmFacts]) -> dict[str, float]:
    """Caps for the VMs sending on one link (the link's rate: no cap below it). Under
    the caps TCP splits the link evenly (:func:`effective`), which is right unless a
    VM's reserve is above what that split gives it:

    - every reserve fits in the even split (≤ link ÷ n): no cap below the link, so
      the link stays full whatever the streams do (one ends, one is CPU-bound);
    - a heavy VM (turned heavy while others ran, by re-plan): the others capped at
      their reserves, the heavy one uncapped (the rest and whatever they leave); two
      heavy ones, or others whose reserves would take half the link: no caps (TCP's
      even split is as good as any);
    - the reserves together exceed the link (a re-plan): in proportion to them;
    - else water-filling at an even level λ with the reserves as floors (Σ max(r, λ)
      = link): the VMs whose reserve is above λ are protected, the others capped at
      λ; one protected VM is left uncapped (it gets at least its reserve and whatever
      the others leave), several get their reserves."""
    if not vms:
        return {}
    res = {f.name: reserve(f, link) for f in vms}
    uncapped = {f.name: link for f in vms}
    if len(vms) == 1 or max(res.values()) <= link / len(vms):
        return uncapped
    hv = {f.name for f in vms if heavy(f, link)}
    if hv:
        others = sum(r for n, r in res.items() if n not in hv)
        if len(hv) > 1 or others >= link / 2:
            return uncapped
        return {n: link if n in hv else r for n, r in res.items()}
    total_res = sum(res.values())
    if total_res >= link:
        return {n: link * r / total_res for n, r in res.items()}
    level = _even_level(link, list(res.values()))
    protected = [n for n, r in res.items() if r > level]
    return {n: (link if len(protected) == 1 else r) if n in protected else level
            for n, r in res.items()}


def _even_level(link: float, floors: list[float]) -> float:
    """λ with Σ max(floor, λ) = link (the floors sum to less than the link)."""
    fixed_sum, rest = 0.0, sorted(floors, reverse=True)
    while rest:
        level = (link - fixed_sum) / len(rest)
        if rest[0] <= level:
            return level
        fixed_sum += rest.pop(0)
    return 0.0


def effective(link: float, caps: dict[str, float]) -> dict[str, float]:
    """What each stream gets under its cap when TCP shares the link evenly (max-min
    fair: a stream capped below the even level keeps its cap, the rest share what it
    leaves)."""
    out: dict[str, float] = {}
    left, rest = link, sorted(caps, key=lambda n: caps[n])
    while rest:
        level = left / len(rest)
        if caps[rest[0]] >= level:
            return {**out, **{n: level for n in rest}}
        n = rest.pop(0)
        out[n] = caps[n]
        left -= caps[n]
    return out


def _why(f: VmFacts, cap: float, rate: float, link: float, n: int) -> str:
    kind = "heavy (throttled even alone)" if heavy(f, link) else (
        "busy" if f.dirty_rate > 0.1 * MAX_Q * link else "idle")
    capped = ("no cap below the link" if cap >= link
              else f"capped at {100 * cap / link:.0f}% of the link")
    return (f"{kind}: dirty {f.dirty_rate / 2**20:.1f} MiB/s, reserve "
            f"{reserve(f, link) / 2**20:.1f} MiB/s; {capped}, ~{100 * rate / link:.0f}% "
            f"of it with {n} migrating")


@dataclass
class Planned:
    """One VM in a simulated plan."""

    name: str
    start: float
    end: float
    work_lost: float
    wave: int  # how many ran at its start (itself included)
    bandwidths: list[float] = field(default_factory=list)
    stream: tuple[float, float] = (0.0, 0.0)  # its stream's start and end (uses the link)


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

    def share_link(self, a: str, b: str) -> bool:
        """Their streams overlap (the overheads around a stream use no link)."""
        (sa, ea), (sb, eb) = self.by_name(a).stream, self.by_name(b).stream
        return sa < eb - 1e-9 and sb < ea - 1e-9

    def by_name(self, name: str) -> Planned:
        return next(p for p in self.vms if p.name == name)

    def max_parallel(self) -> int:
        """Most migrations under way at once, finishing ones included."""
        return max((sum(1 for q in self.vms if q.start <= p.start < q.end)
                    for p in self.vms), default=0)

    def max_active(self) -> int:
        """Most migrations starting or sending at once (what ``max_parallel`` caps)."""
        return max((sum(1 for q in self.vms if q.start <= p.start < q.stream[1])
                    for p in self.vms), default=0)


def simulate(fleet: list[VmFacts], links: dict[str, float], max_parallel: int = 3,
             policy: Callable[[Snapshot], list[Action]] | None = None,
             overhead: Overhead = MODELLED, per_link: int | None = None) -> Plan:
    """Run ``decide`` (or ``policy(snapshot)``) against the model. A migration is
    ``overhead.pre`` without the link, then its stream (the encoding model's time at
    the rate it gets under its cap beside the other streams on its link,
    :func:`effective`; caps and rates change at events), then ``overhead.post``,
    again without the link (the scheduler sees that part as not sending)."""
    choose = policy or decide
    states = {f.name: VmState(f) for f in fleet}
    phase: dict[str, str] = {}  # pre | send | post
    wait: dict[str, float] = {}  # seconds left in pre / post
    planned: dict[str, Planned] = {}
    t = 0.0
    # each pass ends at an event (a phase ends, a stream turns ending): at most a few
    # per VM, and a pass with nothing running ends the loop
    for _ in range(20 * len(fleet) + 20):
        acts = choose(Snapshot(t, tuple(states.values()), links, max_parallel, per_link))
        for a in acts:
            v = states[a.name]
            states[a.name] = replace(v, status=MIGRATING, bandwidth=a.bandwidth)
            if isinstance(a, Start):
                n = sum(1 for x in states.values() if x.status == MIGRATING)
                planned[a.name] = Planned(a.name, t, t, 0.0, n)
                phase[a.name], wait[a.name] = "pre", overhead.pre
            planned[a.name].bandwidths.append(a.bandwidth)
        running = [v for v in states.values() if v.status == MIGRATING]
        if not running:
            break
        rate: dict[str, float] = {}
        for ln, link in links.items():
            rate.update(effective(link, {v.facts.name: v.bandwidth or 1.0 for v in running
                                         if v.facts.link == ln
                                         and phase[v.facts.name] == "send"}))
        stream = {n: _estimate(states[n].facts, r).seconds for n, r in rate.items()}
        left = {v.facts.name: (1.0 - v.progress) * stream[v.facts.name]
                if phase[v.facts.name] == "send" else wait[v.facts.name] for v in running}
        # an event where a stream becomes ending (the scheduler may start the next)
        dt = min([*left.values(), *(x - ENDING_S for n, x in left.items()
                                    if phase[n] == "send" and x > ENDING_S + 1e-6)])
        t += dt
        for v in running:
            name = v.facts.name
            done = left[name] <= dt + 1e-9
            if phase[name] == "send":
                frac = 1.0 - v.progress if done else dt / stream[name]
                planned[name].work_lost += frac * work_lost(v.facts, rate[name])
                if done:
                    planned[name].stream = (planned[name].stream[0], t)
                    phase[name], wait[name] = "post", overhead.post
                    states[name] = replace(v, progress=1.0, sending=False)
                else:
                    states[name] = replace(v, progress=v.progress + frac,
                                           tail_s=left[name] - dt)
            elif not done:
                wait[name] -= dt
            elif phase[name] == "pre":
                phase[name] = "send"
                planned[name].stream = (t, t)
                # its stream's length alone at its cap, until the next event's rates
                states[name] = replace(v, tail_s=_estimate(
                    v.facts, v.bandwidth or links[v.facts.link]).seconds)
            else:
                states[name] = replace(v, status=DONE, progress=1.0, sending=False)
                planned[name].end = t
    left_out = sorted(set(states) - set(planned))
    if left_out:  # a plan without a VM would leave it on the host: never silently
        raise LivemigError(f"internal: the schedule never starts {', '.join(left_out)} "
                           "(a bug: please report it with the --dry-run output)")
    return Plan(sorted(planned.values(), key=lambda p: (p.start, p.name)))


def fixed(concurrency: int) -> Callable[[Snapshot], list[Action]]:
    """A fixed-concurrency baseline (Nova: 1, KubeVirt: 2 per node): the queue in the
    given order, ``concurrency`` at a time, no caps (TCP's even split of the link:
    :func:`effective` in the model). Each start expects an even share of its link with
    the migrations on it (what a profile that models the link plans with; stock
    profiles do not read it)."""
    def policy(s: Snapshot) -> list[Action]:
        running = [v for v in s.vms if v.status == MIGRATING]
        queued = [v for v in s.vms if v.status == QUEUED]
        starting = queued[:max(0, concurrency - len(running))]
        out: list[Action] = []
        for v in starting:
            link = s.links[v.facts.link]
            sharing = sum(1 for x in running + starting if x.facts.link == v.facts.link)
            out.append(Start(v.facts.name, link, f"fixed concurrency {concurrency}",
                             link / sharing))
        return out
    return policy
