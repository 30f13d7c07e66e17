"""Evacuation pieces without a VM: selection, placement, facts from a sample, the
CLI's one-line errors, the report's totals."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from livemig.errors import UsageError
from livemig.evacuate import fleet, report, run, schedule, view
from livemig.evacuate.pool import _interruptible as pool_interruptible
from livemig.evacuate.schedule import SHARED_LINK, VmFacts, simulate
from livemig.policy.encoding import Codec, Sample

M = 2**20


def test_select_domains_and_exclude() -> None:
    names = ["a", "b", "c"]
    assert fleet.select(names, None, []) == names
    assert fleet.select(names, ["c", "a"], ["a"]) == ["c"]
    with pytest.raises(UsageError, match="zz"):
        fleet.select(names, ["a", "zz"], [])


def test_place_by_free_memory_largest_first() -> None:
    vms = [VmFacts("big", 4096 * M, 1, 0), VmFacts("s1", 512 * M, 1, 0),
           VmFacts("s2", 512 * M, 1, 0)]
    where, nowhere = fleet.place(vms, {"d1": 5000 * M, "d2": 2000 * M}, False)
    assert where["big"] == "d1" and nowhere == []
    assert {where["s1"], where["s2"]} == {"d2"}  # d1 has 600 MiB left: less than d2
    where, nowhere = fleet.place(vms, {"d1": 1000 * M}, False)
    assert nowhere == ["big", "s2"] and set(where) == {"s1"}  # s2 no longer fits either


def test_separate_links_place_a_heavy_vm_where_the_plan_ends_soonest() -> None:
    """The busy fleet of docs/results/evacuate-2026-11-27.md (measured facts, two
    100 Mbit/s links): balancing first-pass wire bytes put the whole-page writer
    (heavy: it runs alone on its link) behind two others; placed by the plan's model
    it shares its link with the idle guest only, and the plan ends 7 s sooner."""
    link = 12.5e6
    links = {"d1": link, "d2": link}
    vms = [VmFacts("db0", 192 * M, 153510531, 13042399, 2.084, 28.729),
           VmFacts("db2", 192 * M, 151806959, 8672566, 2.1, 33.597),
           VmFacts("idle", 192 * M, 98724635, 748724, 2.29, 35.885),
           VmFacts("db4", 192 * M, 152180943, 11865405, 2.084, 28.872),
           VmFacts("pages", 192 * M, 152447459, 12356581, 2.058, 1.494)]
    free = {"d1": 8 << 30, "d2": 8 << 30}
    by_model, _ = fleet.place(vms, free, True, links, 6)
    by_bytes, _ = fleet.place(vms, free, True)
    assert by_bytes["pages"] == by_bytes["db2"] == by_bytes["idle"]  # as in the run
    with_pages = {n for n, u in by_model.items() if u == by_model["pages"]}
    assert with_pages == {"pages", "idle"}
    t_model = simulate(fleet.with_links(vms, by_model, True), links, 6).total_s
    t_bytes = simulate(fleet.with_links(vms, by_bytes, True), links, 6).total_s
    assert t_model < t_bytes - 5.0  # negative control: the bytes rule is the slow one
    # memory still decides where a VM can go at all
    where, nowhere = fleet.place(vms, {"d1": 8 << 30, "d2": 300 * M}, True, links)
    assert set(where.values()) == {"d1"} and nowhere == []


def test_with_links() -> None:
    vms = [VmFacts("a", M, 1, 0)]
    assert fleet.with_links(vms, {"a": "d1"}, True)[0].link == "d1"
    assert fleet.with_links(vms, {"a": "d1"}, False)[0].link == SHARED_LINK
    assert fleet.with_links(vms, {}, True) == []


def test_facts_from_a_sample_and_without() -> None:
    s = Sample(looked=100, nonzero=25, kept=25, rewritten=5, interval=0.5,
               first={"zstd": Codec(3.0, 1e8), "plain": Codec(1.0, 1e9)},
               delta={"lz4": Codec(20.0, 1e9)})
    # the sample's own dirty rate (5 of 25 kept pages rewritten in 0.5 s of 250 bytes
    # non-zero: 100 bytes/s), whatever QEMU's window read below it
    f = fleet.facts_from("a", 1000, 7.0, s)
    assert (f.nonzero, f.ratio, f.resend_ratio, f.dirty_rate) == (250, 3.0, 20.0, 100.0)
    few = Sample(looked=100, nonzero=25, kept=10, rewritten=5, interval=0.5)
    assert fleet.facts_from("a", 1000, 7.0, few).dirty_rate == 7.0  # too few to read
    assert fleet.facts_from("a", 1000, None, few).dirty_rate == 0.0  # nothing measured
    g = fleet.facts_from("a", 1000, 7.0, None)
    assert (g.nonzero, g.ratio, g.resend_ratio, g.dirty_rate) == (1000, 1.0, 1.0, 7.0)
    # whole-page rewrites: their deltas pack worse than the pages do
    whole = Sample(looked=100, nonzero=25, kept=25, rewritten=5, interval=0.5,
                   first={"zstd": Codec(2.2, 1e8)}, resend={"zstd": Codec(2.2, 1e8)},
                   delta={"lz4": Codec(1.6, 1e9)})
    assert fleet.facts_from("a", 1000, 7.0, whole).resend_ratio == 2.2


def test_the_dirty_rate_is_the_samples_unless_qemus_window_reads_significantly_more(
        ) -> None:
    """QEMU's window (one changed page of its ~100 on a 192 MiB guest reads 2 MiB/s)
    against the page sample's thousands of pages: set h's whole-page writer, 20 MiB/s
    in the window and 11.3 in the sample, was noise, not a busier guest."""
    mib = float(1 << 20)
    assert fleet.dirty_rate(20 * mib, 11.3 * mib) == (11.3 * mib, "sample")
    assert fleet.dirty_rate(18 * mib, 12 * mib) == (12 * mib, "sample")
    assert fleet.dirty_rate(5 * mib, 12 * mib) == (12 * mib, "sample")
    # 11 changed pages where the sample's rate gives 3 (2σ: 6.5): a busier guest
    assert fleet.dirty_rate(22 * mib, 6 * mib) == (22 * mib, "window")
    # an idle sample: one changed page in the window is noise, three are not
    assert fleet.dirty_rate(2 * mib, 0.0) == (0.0, "sample")
    assert fleet.dirty_rate(6 * mib, 0.0) == (6 * mib, "window")
    assert fleet.dirty_rate(7 * mib, None) == (7 * mib, "window")
    assert fleet.dirty_rate(None, None) == (0.0, "none")
    assert fleet.sample_rate(1000, None) is None


def test_the_fleet_is_sampled_side_by_side_with_the_dirty_rate_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator waits for the slowest measurement, not their sum (as many
    samples at once as the host has CPUs)."""
    doms = {n: SimpleNamespace(name=lambda n=n: n, info=lambda: [1, 1 << 20, 0, 1])
            for n in ("a", "b", "c")}
    monkeypatch.setattr(fleet, "running_domains", lambda conn: doms)

    def slow_rates(conn: object, chosen: list[object]) -> dict[str, float]:
        time.sleep(0.4)
        return {"a": 5.0}

    def slow_sample(conn: object, d: object) -> tuple[None, str]:
        time.sleep(0.4)
        return None, "no sampler here"
    monkeypatch.setattr(fleet, "dirty_rates", slow_rates)
    monkeypatch.setattr(fleet, "sample", slow_sample)
    conn = SimpleNamespace(getInfo=lambda: ["x86_64", 4096, 4, 2000, 1, 1, 4, 1])
    t0 = time.monotonic()
    out, spare = fleet.measure(conn, ["a", "b", "c"])
    assert spare is None  # this connection has no domain statistics
    assert time.monotonic() - t0 < 1.0  # one after the other: 1.6 s
    assert fleet.host_cpus(conn) == 4 and fleet.host_cpus(object()) == 1
    assert [m.facts.name for m in out] == ["a", "b", "c"]
    assert [m.facts.dirty_rate for m in out] == [5.0, 0.0, 0.0]
    assert out[1].note == "dirty rate not measured: assumed 0; no sampler here"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "livemig.cli", "evacuate", *args],
                          capture_output=True, text=True)


@pytest.mark.parametrize("args,msg", [
    (["--connect", "nope", "--to", "qemu+tcp://b/system"], "not a libvirt URI"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://a/system"], "source host"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system,qemu+tcp://b/system"],
     "twice"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system", "--max-time", "0"],
     "--max-time"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--max-parallel", "0"], "--max-parallel"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--scheduler", "fixed:x"], "--scheduler"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system", "--link", "fast"],
     "bad link rate"),
    (["--to", "qemu+tcp://b/system"], "--connect"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system", "--domains", ","],
     "--domains: no domain named"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], msg: str) -> None:
    p = _cli(*args)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr


def test_report_file_not_dir(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("")
    p = _cli("--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
             "--report", str(f))
    assert p.returncode == 2 and "is a file" in p.stderr


def _vm(name: str, status: str, rep: dict[str, object] | None = None) -> run.Vm:
    v = run.Vm(VmFacts(name, 128 * M, 64 * M, 0.0), "qemu+tcp://10.77.0.2/system",
               status=status, attempts=1, started=0.0, ended=5.0 if status == "done" else None)
    if rep is not None:
        v.reports.append(rep)
        v.tries.append({"attempt": 1, "t": 0.0, "end": 5.0})
    return v


def test_report_totals_and_chart(tmp_path: Path) -> None:
    ok = {"outcome": "completed", "downtime_ms": 120, "ram_transferred_bytes": 10 * M,
          "consistency": {"ram": "ok"}}
    bad = {"outcome": "failed", "ram_transferred_bytes": 3 * M, "consistency": {}}
    vms = [_vm("a", "done", ok), _vm("b", "failed", bad)]
    evac = SimpleNamespace(vms=vms, cancelled="", events=[],
                           o=SimpleNamespace(links={SHARED_LINK: 100 * M}, max_parallel=3))
    plan = simulate([v.facts for v in vms], {SHARED_LINK: 100 * M})
    rep = report.build(evac, plan, {}, [], 6.0)
    assert rep["outcome"] == "incomplete" and rep["time_to_empty_s"] is None
    assert rep["bytes"] == 13 * M and rep["longest_pause_ms"] == 120
    assert rep["failures"] == ["b"] and rep["left_on_source"] == ["b"]
    assert rep["verified"] == 1
    path = report.chart(rep, tmp_path)
    assert path is not None and path.stat().st_size > 0
    vms[1].status, vms[1].ended = "done", 5.5
    vms[1].reports[-1] = ok
    rep = report.build(evac, plan, {}, [], 6.0)
    assert rep["outcome"] == "emptied" and rep["time_to_empty_s"] == 5.5


def test_view_lines() -> None:
    v = _vm("a", "migrating")
    v.live = {"rounds": 3, "remaining": 4 * M, "total": 128 * M, "bps": 2 * M}
    v.bandwidth = 50 * M
    line = view.vm_line(v, 1.0)
    assert "round 3" in line and "ETA 2 s" in line and "10.77.0.2" in line
    host = view.host_line([v, _vm("b", "queued")], {SHARED_LINK: 100 * M}, 1.0)
    assert "2 of 2 VMs left" in host and "ETA to empty" in host


class _NoConn:
    def lookupByName(self, name: str) -> object:
        raise RuntimeError("no job")


def _fake_children(monkeypatch: pytest.MonkeyPatch, fail: set[str],
                   seconds: float = 0.0) -> list[str]:
    """Children that write a report (failed for ``fail``) instead of migrating."""
    import json

    started: list[str] = []

    class FakePool:
        def __init__(self, size: int, env: dict[str, str]) -> None:
            self.env = env

        def fill(self, wanted: int) -> None:
            pass

        def close(self) -> None:
            pass

        cold = 0

        def run(self, cmd: list[str], log: Path, env: dict[str, str],
                unset: list[str]) -> subprocess.Popen[bytes]:
            name = cmd[cmd.index("--domain") + 1]
            report = Path(cmd[cmd.index("--report") + 1])
            started.append(name)
            ok = name not in fail
            report.write_text(json.dumps({"outcome": "completed" if ok else "failed",
                                          "reason": None if ok else "boom",
                                          "consistency": {"ram": "ok" if ok else None},
                                          "ram_transferred_bytes": M, "downtime_ms": 50}))
            # SIGINT as the pool's children get it (the test may run with it ignored)
            return subprocess.Popen(["sleep", str(seconds)] if ok or seconds else ["false"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    preexec_fn=pool_interruptible)
    monkeypatch.setattr(run, "Pool", FakePool)
    monkeypatch.setattr(run, "POLL_S", 0.05)
    monkeypatch.setattr(run, "RETRY_DELAY_S", 0.1)
    return started


def _evac(tmp_path: Path, names: list[str], max_time: float | None = None) -> run.Evacuation:
    vms = [run.Vm(VmFacts(n, 128 * M, 32 * M, 0.0), "qemu+tcp://d/system") for n in names]
    opts = run.Options(src_uri="qemu+tcp://s/system", profile="livemig", out=tmp_path,
                       links={SHARED_LINK: 100 * M}, max_parallel=2, max_time=max_time)
    return run.Evacuation(opts, vms, _NoConn())


def test_a_failed_vm_is_retried_once_then_reported_and_the_others_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = _fake_children(monkeypatch, fail={"b"})
    evac = _evac(tmp_path, ["a", "b", "c"])
    evac.run()
    st = {v.name: v.status for v in evac.vms}
    assert st == {"a": "done", "b": "failed", "c": "done"}
    assert started.count("b") == 2 and started.count("a") == 1
    b = next(v for v in evac.vms if v.name == "b")
    assert b.attempts == 2 and b.reason == "boom" and len(b.tries) == 2
    assert (tmp_path / "b.try2.json").exists()


def test_max_time_cancels_and_nothing_queued_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = _fake_children(monkeypatch, fail=set(), seconds=30)
    evac = _evac(tmp_path, ["a", "b", "c", "d"], max_time=1.0)
    t0 = __import__("time").monotonic()
    evac.run()
    assert __import__("time").monotonic() - t0 < 10  # the children got SIGINT
    assert len(started) == 2  # max_parallel; the queued two never started
    st = {v.name: v.status for v in evac.vms}
    assert sorted(st.values()) == ["aborted"] * 4
    assert "--max-time" in evac.cancelled


def test_progress_from_job_stats_shares_the_link_by_what_is_left() -> None:
    assert run.progress({}) == 0.0
    assert run.progress({"total": 100, "remaining": 25}) == 0.75
    assert run.progress({"total": 100, "remaining": 500}) == 0.0


class _Dom:
    def __init__(self, emulator: str) -> None:
        self._xml = f"<domain><devices><emulator>{emulator}</emulator></devices></domain>"

    def XMLDesc(self, _flags: int) -> str:
        return self._xml


class _Src:
    def __init__(self, doms: dict[str, str]) -> None:
        self.doms = doms

    def lookupByName(self, name: str) -> _Dom:
        return _Dom(self.doms[name])


def test_doctor_gate_checks_each_destination_with_the_domains_emulators(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from livemig.doctor import gate
    from livemig.doctor.checks import Finding
    from livemig.errors import SetupError
    from livemig.evacuate.cli import doctor_gate

    asked: list[tuple[str, str | None, bool]] = []

    def fake(uri: str, emu: object = None, tls_required: bool = True) -> gate.Verdict:
        asked.append((uri, str(emu) if emu else None, tls_required))
        if uri.endswith("c/system"):
            return gate.Verdict([Finding("fail", "emulator", "/opt/q: no such binary")],
                                None)
        # d runs a stock QEMU at both paths; b a patched one at /opt/q only
        return gate.Verdict([], f"{emu} is stock" if uri.endswith("d/system") or
                            str(emu) != "/opt/q" else None)

    monkeypatch.setattr(gate, "examine", fake)
    src = _Src({"a": "/opt/q", "b": "/opt/q", "c": "/usr/bin/qemu-system-x86_64"})
    assert doctor_gate(src, ["a", "b"], "qemu+tls://a/system", ["qemu+tls://b/system"]) == {}
    assert asked == [("qemu+tls://b/system", "/opt/q", True)]  # one emulator, TLS between hosts
    # a destination is stock only when every emulator the domains name is
    assert doctor_gate(src, ["a", "c"], "qemu+tls://a/system",
                       ["qemu+tls://b/system", "qemu+tls://d/system"]) == {
        "qemu+tls://d/system": "/opt/q is stock; /usr/bin/qemu-system-x86_64 is stock"}
    asked.clear()
    with pytest.raises(SetupError, match=r"qemu\+tls://c/system cannot take part: emulator"):
        doctor_gate(src, ["a", "c"], "qemu+tls://a/system",
                    ["qemu+tls://b/system", "qemu+tls://c/system"])
    assert len(asked) == 3  # b with both emulators, then c's first fails


class _TimedJobs:
    """A source daemon whose jobs prepare for 0.3 s, stream until 0.6 s after their
    first look, switch over and finish until 0.8 s, then are gone (the child only
    reports)."""

    def __init__(self) -> None:
        self.t0: dict[str, float] = {}

    def lookupByName(self, name: str) -> object:
        t = time.monotonic() - self.t0.setdefault(name, time.monotonic())

        def job_stats() -> dict[str, int]:
            if t >= 0.8:
                return {"type": 0}
            return {"type": 2, "memory_total": 128 * M,
                    "memory_remaining": 0 if t >= 0.6 else 64 * M,
                    "memory_processed": 0 if t < 0.3 else 64 * M, "memory_bps": M}
        return SimpleNamespace(jobStats=job_stats)


def test_the_drain_measures_what_a_migration_costs_beyond_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first byte (child, prepare) and after the last (switchover, finish,
    confirm, check): the live ETA and the report take the drain's own figures once a
    migration has completed, the model's before."""
    _fake_children(monkeypatch, fail=set(), seconds=1.3)
    evac = _evac(tmp_path, ["a", "b"])
    evac.conn = _TimedJobs()
    assert evac.overhead() == schedule.MODELLED
    evac.run()
    assert len(evac.overheads) == 2
    got = evac.overhead()
    # after the last byte: the switchover and finish (0.2 s) and the child (0.5 s)
    assert 0.2 < got.pre < 0.6 and 0.5 < got.post < 1.0, evac.overheads
    plan = simulate([v.facts for v in evac.vms], {SHARED_LINK: 100 * M})
    rep = report.build(evac, plan, {}, [], 2.0)
    assert rep["overhead_s"]["measured"]["migrations"] == 2
    assert rep["overhead_s"]["modelled"]["pre"] == schedule.MODELLED.pre


def test_the_eta_counts_what_follows_a_stream_as_the_drain_measured_it() -> None:
    v = _vm("a", "migrating")
    v.live = {"rounds": 3, "remaining": 4 * M, "total": 128 * M, "bps": 2 * M}
    cheap = schedule.Overhead(0.5, 1.0)
    assert view.vm_eta(v, 1.0, cheap) == 3.0  # 2 s of stream, then 1 s
    v.live["remaining"], v.last_byte = 0, 10.0  # switched over: finishing
    assert view.vm_eta(v, 10.4, cheap) == pytest.approx(0.6)
    assert view.vm_eta(v, 12.0, cheap) == 0.0
    q = [_vm("b", "queued")]
    modelled = view.host_line(q, {SHARED_LINK: 100 * M}, 0.0)
    measured = view.host_line(q, {SHARED_LINK: 100 * M}, 0.0, cheap)
    eta = [float(x.split("ETA to empty ")[1].split()[0]) for x in (modelled, measured)]
    assert eta[0] - eta[1] == pytest.approx(schedule.MODELLED.total - cheap.total, abs=1)


def test_the_link_comes_from_the_option_then_the_testbed_then_the_route(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from livemig.evacuate import cli
    from livemig.testbed import topology

    monkeypatch.setattr(topology, "read_state", lambda: {"link_bits": 400e6})
    route = (12.5e6, "tbf on mig0 to 10.77.0.2")
    a = SimpleNamespace(link="1gbit", quiet=False)
    assert cli._link_bytes(a, True, lambda: route) == 1e9 / 8
    a = SimpleNamespace(link=None, quiet=False)
    assert cli._link_bytes(a, True, lambda: route) == 400e6 / 8
    assert cli._link_bytes(a, False, lambda: route) == 12.5e6
    assert "100 Mbit/s (tbf on mig0 to 10.77.0.2)" in capsys.readouterr().err
    with pytest.raises(UsageError, match="could not be read"):
        cli._link_bytes(a, False, lambda: None)


def test_route_link_is_the_slowest_route_and_needs_every_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from livemig.engine import linkprobe
    from livemig.evacuate import cli
    from livemig.virt import sampling

    rates = {"10.77.0.2": 12.5e6, "10.77.2.3": 5e6}
    monkeypatch.setattr(sampling, "local_pid", lambda dom: 77 if dom == "db" else None)
    monkeypatch.setattr(linkprobe, "source_link", lambda pid, peer: linkprobe.Link(
        rates[peer], "tbf on mig0") if peer in rates and pid == 77 else None)
    src = SimpleNamespace(lookupByName=lambda n: n)
    dsts = ["qemu+tcp://10.77.0.2/system", "qemu+tcp://10.77.2.3/system"]
    # the first domain runs elsewhere: the next one's process is used
    assert cli.route_link(src, ["remote", "db"], dsts) == (5e6, "tbf on mig0 to 10.77.2.3")
    assert cli.route_link(src, ["remote"], dsts) is None  # no QEMU on this host
    assert cli.route_link(src, ["db"], [*dsts, "qemu:///system"]) is None  # one unread
