"""The evacuation scheduler on synthetic fleets (no VM): the rule, and that the model
agrees with it."""

from __future__ import annotations

from dataclasses import replace

from livemig.evacuate.schedule import (
    MIGRATING,
    MIN_SHARE,
    SetBandwidth,
    Snapshot,
    Start,
    VmFacts,
    VmState,
    decide,
    fixed,
    heavy,
    reserve,
    seconds,
    simulate,
    work_lost,
)

M = 2**20
LINK = 100 * M  # bytes/s
LINKS = {"link": LINK}


def idle(name: str) -> VmFacts:
    return VmFacts(name, 192 * M, 40 * M, 0.2 * M, ratio=2.0, resend_ratio=4.0)


def busy(name: str, dirty: float = 30 * M) -> VmFacts:
    """Converges alone (reserve 0.6 of the link at 36 MiB/s), not two at a time."""
    return VmFacts(name, 192 * M, 150 * M, dirty, ratio=1.0, resend_ratio=1.0)


def hog(name: str) -> VmFacts:
    """Needs a throttle even with the whole link."""
    return VmFacts(name, 192 * M, 150 * M, 120 * M)


def test_two_busy_vms_never_share_the_link_when_together_they_would_not_converge() -> None:
    a, b = busy("a", 36 * M), busy("b", 36 * M)
    assert not heavy(a, LINK) and reserve(a, LINK) + reserve(b, LINK) > LINK
    plan = simulate([a, b], LINKS, max_parallel=4)
    assert not plan.overlap("a", "b")
    assert plan.work_lost == 0.0
    # and the model says why: at half the link each needs a throttle (guest harm)
    assert work_lost(a, LINK / 2) > 0.0 and work_lost(a, LINK) == 0.0
    # the fixed-concurrency baseline shares and pays for it
    assert simulate([a, b], LINKS, policy=fixed(2)).work_lost > 0.0


def test_busy_vms_that_converge_together_do_share() -> None:
    a, b = busy("a", 10 * M), busy("b", 10 * M)
    assert reserve(a, LINK) + reserve(b, LINK) <= LINK
    plan = simulate([a, b], LINKS)
    assert plan.overlap("a", "b")
    assert plan.total_s < seconds(a, LINK) + seconds(b, LINK)


def test_idle_vms_go_first_and_in_parallel_up_to_max_parallel() -> None:
    fleet = [hog("h"), busy("b"), *(idle(f"i{i}") for i in range(4))]
    plan = simulate(fleet, LINKS, max_parallel=3)
    order = plan.order()
    assert set(order[:3]) <= {"i0", "i1", "i2", "i3"}
    assert order[-1] == "h"
    assert plan.max_parallel() == 3
    assert plan.overlap("i0", "i1")


def test_a_heavy_vm_runs_alone_with_the_whole_link() -> None:
    fleet = [hog("h"), idle("i0"), idle("i1")]
    plan = simulate(fleet, LINKS, max_parallel=3)
    h = plan.by_name("h")
    assert not plan.overlap("h", "i0") and not plan.overlap("h", "i1")
    assert h.bandwidths == [LINK]


def test_nothing_starts_beside_a_heavy_vm() -> None:
    s = Snapshot(0.0, (VmState(hog("h"), MIGRATING, LINK), VmState(idle("i"))), LINKS)
    assert decide(s) == []


def test_heavy_is_last_even_if_listed_first_and_the_queue_is_not_overtaken() -> None:
    s = Snapshot(0.0, (VmState(hog("h")), VmState(idle("i"))), LINKS, max_parallel=4)
    acts = decide(s)
    assert [a.name for a in acts] == ["i"]
    # a running busy VM leaves no room for a second busy one; an idle one sorts
    # ahead of it and fits beside the first
    b1, b2 = busy("b1", 36 * M), busy("b2", 36 * M)
    s = Snapshot(0.0, (VmState(b1, MIGRATING, LINK), VmState(b2), VmState(idle("z"))),
                 LINKS, max_parallel=4)
    assert [a.name for a in decide(s) if isinstance(a, Start)] == ["z"]
    # and one queued behind a busy VM that does not fit waits (no overtaking)
    b3 = busy("b3", 40 * M)
    s = Snapshot(0.0, (VmState(b1, MIGRATING, LINK), VmState(b2), VmState(b3)),
                 LINKS, max_parallel=4)
    assert not [a for a in decide(s) if isinstance(a, Start)]


def test_shares_never_exceed_the_link_and_every_runner_gets_its_reserve() -> None:
    fleet = [busy("b", 20 * M), *(idle(f"i{i}") for i in range(3))]
    acts = decide(Snapshot(0.0, tuple(VmState(f) for f in fleet), LINKS, max_parallel=4))
    assert {a.name for a in acts} == {"b", "i0", "i1", "i2"}
    assert sum(a.bandwidth for a in acts) <= LINK * 1.0001
    for a in acts:
        f = next(f for f in fleet if f.name == a.name)
        assert a.bandwidth >= reserve(f, LINK) >= MIN_SHARE * LINK


def test_replan_a_vm_measured_busier_gets_more_of_the_link() -> None:
    b, i = busy("b", 5 * M), replace(idle("i"), nonzero=180 * M, ratio=1.0)
    first = {a.name: a.bandwidth for a in decide(Snapshot(
        0.0, (VmState(b), VmState(i)), LINKS))}
    hotter = replace(b, dirty_rate=30 * M)
    acts = decide(Snapshot(5.0, (VmState(hotter, MIGRATING, first["b"]),
                                 VmState(i, MIGRATING, first["i"])), LINKS))
    new = {a.name: a.bandwidth for a in acts if isinstance(a, SetBandwidth)}
    assert new["b"] > first["b"] and new["b"] >= reserve(hotter, LINK)
    assert new["i"] < first["i"]
    # turned heavy mid-flight: it takes all but the other's reserve
    acts = decide(Snapshot(6.0, (VmState(replace(b, dirty_rate=120 * M), MIGRATING, new["b"]),
                                 VmState(i, MIGRATING, new["i"])), LINKS))
    bw = {a.name: a.bandwidth for a in acts}
    assert bw["b"] == LINK - reserve(i, LINK)


def test_separate_links_let_busy_vms_run_at_once() -> None:
    a = replace(busy("a", 36 * M), link="dst")
    b = replace(busy("b", 36 * M), link="dst2")
    plan = simulate([a, b], {"dst": LINK, "dst2": LINK})
    assert plan.overlap("a", "b")


def test_beats_fixed_concurrency_on_time_plus_guest_harm() -> None:
    fleet = [idle("i0"), idle("i1"), idle("i2"), busy("b0", 36 * M), busy("b1", 36 * M),
             hog("h")]
    ours = simulate(fleet, LINKS, max_parallel=3)
    for n in (1, 2, len(fleet)):
        base = simulate(fleet, LINKS, policy=fixed(n))
        assert ours.total_s + ours.work_lost < base.total_s + base.work_lost, n
    assert ours.total_s < simulate(fleet, LINKS, policy=fixed(1)).total_s


def test_a_wrong_rule_fails_these_tests() -> None:
    """Negative control: a scheduler that starts everything at once shares the busy
    pair, which the first test would catch."""
    a, b = busy("a", 36 * M), busy("b", 36 * M)
    plan = simulate([a, b], LINKS, policy=fixed(2))
    assert plan.overlap("a", "b") and plan.work_lost > 0.0


def test_links_take_turns_so_none_idles() -> None:
    """Three VMs for one destination, one for another, two at a time: the second
    link's VM starts at once instead of waiting behind the first link's queue."""
    fleet = [replace(idle(f"a{i}"), link="d1") for i in range(3)] + [
        replace(idle("b0"), link="d2")]
    acts = decide(Snapshot(0.0, tuple(VmState(f) for f in fleet),
                           {"d1": LINK, "d2": LINK}, max_parallel=2))
    assert sorted(a.name for a in acts) == ["a0", "b0"]


def test_a_light_vm_with_much_to_send_is_not_starved_by_a_busy_reserve() -> None:
    """Shares follow the remaining bytes, with each VM's reserve as a floor only."""
    b = busy("b", 20 * M)  # reserve 50 MiB/s
    big = replace(idle("i"), nonzero=400 * M, ratio=1.0)
    acts = {a.name: a.bandwidth for a in decide(Snapshot(
        0.0, (VmState(b), VmState(big)), LINKS))}
    assert acts["b"] == reserve(b, LINK)
    assert abs(acts["i"] - (LINK - reserve(b, LINK))) < 1.0
