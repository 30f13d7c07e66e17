"""The evacuation hands each child the page sample it measured (no second sample per
migration), and takes a VM off its link as soon as its stream ends. No VM."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from livemig.engine.adapt import Hints, sampler_for
from livemig.engine.events import EventStream
from livemig.evacuate import fleet, run
from livemig.evacuate.schedule import SHARED_LINK, VmFacts
from livemig.policy.encoding import Codec, Sample
from livemig.sampling import given
from livemig.sampling.base import SampleResult
from livemig.virt.sampling import given_sample

M = 2**20
SAMPLE = Sample(looked=7000, nonzero=5000, kept=4096, rewritten=70, interval=0.5,
                changed_share=0.004, zlib_ratio=None,
                first={"zstd": Codec(2.2, 9e7), "plain": Codec(1.0, 1e9)},
                resend={"zstd": Codec(20.0, 2e8)}, delta={"lz4": Codec(90.0, 5e8)})
RESULT = SampleResult(SAMPLE, "qemu", 1.2, {"qemu": {"blocks": 6}})


def test_a_sample_round_trips_through_its_file(tmp_path: Path) -> None:
    p = tmp_path / "a.sample.json"
    given.dump(p, "a", RESULT, time.time() - 5)
    got, why = given.load(p, "a")
    assert why == "" and got is not None
    assert got.sample == SAMPLE and got.sampler == "qemu"
    assert got.detail["given"] == str(p) and 4 < got.detail["age_s"] < 10


@pytest.mark.parametrize("domain,age,text,msg", [
    ("b", 5, None, "not 'b'"),
    ("a", given.MAX_AGE_S + 5, None, "ago"),
    ("a", -120, None, "ago"),  # from the future: a clock that jumped
    ("a", 5, "{not json", "not a usable sample"),
    ("a", 5, json.dumps({"format": 99}), "format 99"),
    # taken_at is filled in when the case runs: parameters are built at collection,
    # which in a full run is many minutes before this case
    ("a", 5, json.dumps({"format": given.FORMAT, "domain": "a", "taken_at": "NOW"}),
     "not a usable sample"),
])
def test_a_sample_not_this_domains_or_stale_or_broken_is_refused(
        tmp_path: Path, domain: str, age: float, text: str | None, msg: str) -> None:
    p = tmp_path / "a.sample.json"
    given.dump(p, "a", RESULT, time.time() - age)
    if text is not None:
        p.write_text(text.replace('"NOW"', repr(time.time())))
    got, why = given.load(p, domain)
    assert got is None and msg in why and "\n" not in why
    assert given.load(tmp_path / "missing.json", "a")[0] is None


def test_the_given_sampler_is_used_for_auto_only() -> None:
    s = given.GivenSampler(RESULT)
    src: Any = type("End", (), {"cmd": None, "pid": None})()
    picked, close = sampler_for(src, "auto", {"x-calc-ram-sample"}, Hints(given=s))
    assert picked is s and asyncio.run(picked.sample()) is RESULT
    close()
    # sampler=qemu asked explicitly: the QEMU's own, not the given one
    picked, _ = sampler_for(src, "qemu", {"x-calc-ram-sample"}, Hints(given=s))
    assert picked is not s and picked.name == "qemu"


def test_the_child_reads_the_file_its_environment_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "a.sample.json"
    given.dump(p, "a", RESULT, time.time())
    ev = EventStream()
    monkeypatch.delenv(given.ENV, raising=False)
    assert given_sample("a", ev) is None and ev.log == []
    monkeypatch.setenv(given.ENV, str(p))
    s = given_sample("a", ev)
    assert s is not None and ev.log[-1]["event"] == "page sample reused"
    assert given_sample("other", ev) is None  # another domain's: it samples itself
    assert ev.log[-1]["event"] == "page sample not reused" and "not 'other'" in ev.log[-1]["why"]


def test_the_measurement_writes_a_file_per_sampled_vm(tmp_path: Path) -> None:
    f = VmFacts("a", 128 * M, 64 * M, 0.0)
    m = fleet.Measured(f, 1, "qemu", "", RESULT, time.time())
    path = fleet.write_sample(tmp_path, m)
    assert path == tmp_path / "a.sample.json" and given.load(path, "a")[0] is not None
    assert fleet.write_sample(tmp_path, fleet.Measured(f, 1, None, "no sample")) is None


class _Dom:
    def __init__(self, answers: list[dict[str, Any] | Exception]) -> None:
        self.answers = answers

    def jobStats(self) -> dict[str, Any]:
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


class _Conn:
    def __init__(self, dom: _Dom) -> None:
        self.dom = dom

    def lookupByName(self, name: str) -> _Dom:
        return self.dom


def _evac(tmp_path: Path, conn: Any, sample: Path | None = None) -> run.Evacuation:
    vms = [run.Vm(VmFacts("a", 128 * M, 32 * M, 0.0), "qemu+tcp://d/system",
                  sample_file=sample)]
    opts = run.Options(src_uri="qemu+tcp://s/system", profile="livemig", out=tmp_path,
                       links={SHARED_LINK: 12 * M}, max_parallel=2, max_time=None)
    return run.Evacuation(opts, vms, conn)


ACTIVE = {"type": 2, "memory_iteration": 1, "memory_remaining": 50 * M,
          "memory_processed": 78 * M,
          "memory_total": 128 * M, "memory_bps": 10 * M}


def test_a_stream_is_over_once_its_job_was_seen_and_is_gone(tmp_path: Path) -> None:
    # before the job (the child still starting): not over; then running; then gone
    dom = _Dom([{"type": 0}, ACTIVE, {"type": 0}])
    evac = _evac(tmp_path, _Conn(dom))
    v = evac.vms[0]
    evac._live(v)
    assert not v.live.get("sent")
    evac._live(v)
    assert v.live["job"] and not v.live.get("sent")
    evac._live(v)
    assert v.live["sent"]
    # the domain gone from the source (undefined) after its job: over too
    dom.answers = [ACTIVE, RuntimeError("no domain")]
    v.live = {}
    evac._live(v)
    evac._live(v)
    assert v.live["sent"]
    # and never seen running: an error is not an end
    dom.answers = [RuntimeError("no job yet")]
    v.live = {}
    evac._live(v)
    assert not v.live.get("sent")
    # a job gone before its first byte (an attempt the destination's QEMU refused at
    # its start) is no end either: the child's retry streams next
    v.live, v.first_byte, v.last_byte = {}, None, None
    dom.answers = [{**ACTIVE, "memory_processed": 0}, {"type": 0}, ACTIVE, {"type": 0}]
    evac._live(v)
    evac._live(v)
    assert v.live["job"] and not v.live.get("sent")
    evac._live(v)
    evac._live(v)
    assert v.live["sent"]


def test_the_child_gets_the_sample_and_its_expected_rate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def run_child(cmd: list[str], log: Path, env: dict[str, str],
                  unset: list[str]) -> subprocess.Popen[bytes]:
        seen["cmd"], seen["env"], seen["unset"] = cmd, env, unset
        return subprocess.Popen(["true"])
    monkeypatch.setenv(given.ENV, "/elsewhere/inherited.json")
    p = tmp_path / "a.sample.json"
    evac = _evac(tmp_path, _Conn(_Dom([])), sample=p)
    assert given.ENV not in evac.pool.env  # the children inherit none
    monkeypatch.setattr(evac.pool, "run", run_child)
    v = evac.vms[0]
    evac._start(v, 12 * M, "why", 4 * M)
    assert seen["env"][given.ENV] == str(p)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--bandwidth") + 1] == "12M"
    assert "link-rate=33.6mbit" in cmd  # 4 MiB/s
    assert v.tries[-1]["sample_given"] and v.tries[-1]["expected"] == 4 * M
    # no sample measured: nothing inherited is passed on either
    v.sample_file = None
    evac._start(v, 12 * M, "why", 12 * M)
    assert given.ENV not in seen["env"] and given.ENV in seen["unset"]
    assert v.proc is not None
    v.proc.wait()


def test_phases_split_a_vm_into_its_parts(tmp_path: Path) -> None:
    from livemig.evacuate import phases

    t0 = 1_800_000_000.0
    child = tmp_path / "a.json"
    born = datetime.datetime.fromtimestamp(t0 + 1.5, datetime.UTC).isoformat()
    child.write_text(json.dumps({
        "started_at": born, "events": [{"t": 0.4, "event": "migration started"}],
        "qemu_final_stats": {"time_elapsed": 6000}, "total_time_s": 8.0,
        "encoding": {"sampler": {"name": "qemu", "wall_s": 1.2, "given": "x"}},
        "ram_transferred_bytes": 40_000_000}))
    (tmp_path / "evacuation.json").write_text(json.dumps({
        "started_at": t0, "vms": [{"name": "a", "outcome": "done", "end_s": 10.5,
                                   "tries": [{"t": 0.1, "report": str(child),
                                              "bandwidth": 1e6}]}]}))
    (v,) = phases.of_run(tmp_path)
    assert (round(v.up, 3), v.prepare, v.sample, v.qemu, v.finish) == (1.4, 0.4, 0.0, 6.0, 2.0)
    assert round(v.after, 3) == 0.6  # 10.5 - (1.5 + 0.4 + 8.0)
    assert phases.main([str(tmp_path)]) == 0
    assert phases.main([str(tmp_path / "nothing")]) == 2


def test_bench_configurations_and_a_run_without_a_report() -> None:
    from livemig.evacuate import bench

    assert [c[0] for c in bench.configs(5)] == ["fixed:1", "fixed:2", "fixed:5", "livemig"]
    picked = bench.configs(5, ["livemig-upstream", "fixed:5"])
    assert [(c[0], c[1], c[2]) for c in picked] == [
        ("fixed:5", "fixed:5", "upstream"), ("livemig-upstream", "livemig", "upstream")]
    (ablation,) = bench.configs(5, ["fixed:1@livemig"])
    assert ablation[:3] == ("fixed:1@livemig", "fixed:1", "livemig")
    assert "qemu-upstream" not in str(ablation[3])  # the profile on the patched build
    ok = {"time_to_empty_s": 12.0, "bytes": 130 * M, "longest_pause_ms": 900,
          "expected_s": 14.0, "measure_s": 6.0, "verified": 5, "vms": [{}] * 5,
          "outcome": "emptied"}
    dead = {"outcome": "no report (exit -11)", "time_to_empty_s": None, "bytes": 0,
            "longest_pause_ms": None, "expected_s": None, "verified": 0, "vms": []}
    md = bench.table({"livemig": [ok, dead]})
    assert "| livemig | 2 | 12.0 | 12.0, - |" in md and "| 1/2 |" in md


def test_a_patched_qemu_on_this_host_is_read_through_its_mapping_before_migrate(
        tmp_path: Path) -> None:
    """With a stock destination the user waits for the sample before `migrate`: the
    /proc/PID/mem reader, which decides most guests at its half-way look, comes
    before QEMU's own two looks 0.45 s apart; beside the first pass (a destination
    that can switch codecs) and for a QEMU elsewhere, QEMU's own."""
    local: Any = type("End", (), {"cmd": None, "pid": os.getpid()})()
    away: Any = type("End", (), {"cmd": None, "pid": None})()
    own = {"x-calc-ram-sample"}
    picked, close = sampler_for(local, "auto", own, Hints(scratch=tmp_path),
                                before_migrate=True)
    try:
        assert picked.name == "procmem"
    finally:
        close()
    assert sampler_for(local, "auto", own, Hints(scratch=tmp_path))[0].name == "qemu"
    assert sampler_for(away, "auto", own, Hints(), before_migrate=True)[0].name == "qemu"
    # asked for by name: QEMU's own, whenever
    assert sampler_for(local, "qemu", own, Hints(), before_migrate=True)[0].name == "qemu"
