"""The page samplers' pure parts: RAM layout, cluster picks, QEMU's reply, the peek
sampler against an in-memory guest, and the second plan (engine.adapt) on a scripted
QEMU. The samplers on real QEMUs are in test_sampling_vm.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import pytest

from livemig.engine import second_look
from livemig.engine.adapt import START_EXTRA, Hints, adapt, multifd_codecs
from livemig.engine.events import EventStream
from livemig.engine.executor import PolicyConfig, PolicyExecutor
from livemig.engine.plan import Plan
from livemig.engine.qmpactuator import QmpActuator
from livemig.engine.run import Engine
from livemig.engine.second_look import Beside
from livemig.engine.switch import changes, switch
from livemig.errors import VMError
from livemig.idlecpu import IdleMeter
from livemig.policy import encoding
from livemig.sampling.dirtyrate import ShortRate
from livemig.sampling.layout import RamRange, parse_mtree
from livemig.sampling.peek import FIRST_PASS_S, MAX_LOOK, PeekSampler, clusters
from livemig.sampling.qemu import QemuSampler, parse
from livemig.sampling.readers import ProcMemReader, XpReader, parse_gpa2hva
from livemig.settings import SWITCH_CAP, merge

PAGE = 4096
DATA = Path(__file__).resolve().parents[1] / "data"


def test_layout_from_mtree_has_the_ram_above_4g_and_skips_the_holes():
    ranges = parse_mtree((DATA / "mtree-q35-5g.txt").read_text())
    assert [(r.gpa, r.size) for r in ranges] == [(0x100000, 0x7ff00000),
                                                  (0x100000000, 0xc0000000)]
    assert {r.name for r in ranges} == {"pc.ram"}


def test_layout_without_ram_is_an_error():
    with pytest.raises(VMError, match="no guest RAM"):
        parse_mtree('FlatView #0\n AS "memory", root: system\n'
                    "  0000000000000000-0000000000000007 (prio 0, i/o): x\n")


def test_clusters_are_distinct_aligned_inside_the_ram_and_spread_by_size():
    ranges = [RamRange(0x100000, 0x7ff00000, "a"), RamRange(0x100000000, 0xc0000000, "a")]
    got = clusters(ranges, 4000, 16, random.Random(3))
    assert len(got) == len(set(got)) == 4000
    assert all(any(r.gpa <= g and g + 16 * PAGE <= r.gpa + r.size for r in ranges)
               for g in got)
    high = sum(1 for g in got if g >= 0x100000000) / len(got)
    assert abs(high - 0xc0000000 / (0xc0000000 + 0x7ff00000)) < 0.05


class Guest:
    """Guest RAM in a bytearray: half zero, half text; a writer rewrites 64 bytes of
    some pages between the two looks."""

    def __init__(self, size: int = 64 << 20, every: int = 2) -> None:
        rng = random.Random(1)
        self.ram = bytearray(size)
        text = (b"UPDATE accounts SET balance = balance + 1 WHERE id = 42; " * 80)[:PAGE]
        for p in range(0, size // PAGE, every):
            self.ram[p * PAGE:(p + 1) * PAGE] = text
        self.hot = [p for p in range(0, size // PAGE, every) if rng.random() < 0.3]
        self.reads = 0

    def write(self) -> None:
        for p in self.hot:
            o = p * PAGE + 1000
            self.ram[o:o + 64] = random.randbytes(64)

    async def read(self, gpa: int, size: int) -> bytes:
        self.reads += 1
        off = gpa - 0x100000
        return bytes(self.ram[off:off + size])

    async def hmp(self, line: str) -> str:
        assert line == "info mtree -f"
        end = 0x100000 + len(self.ram) - 1
        return (f'FlatView #0\n AS "memory", root: system\n'
                f"  0000000000100000-{end:016x} (prio 0, ram): pc.ram\n")


def _while_writing(g: Guest, sampler: PeekSampler, interval: float, every: float) -> Any:
    """``sampler``'s sample of 512 pages while ``g``'s writer runs every ``every`` s."""
    async def go() -> Any:
        task = asyncio.create_task(sampler.sample(512, interval))
        await asyncio.sleep(every)
        while not task.done():
            g.write()
            await asyncio.sleep(every)
        return task.result()
    return asyncio.run(go())


def test_peek_sampler_sees_the_rewrites_and_the_model_picks_deltas():
    g = Guest()
    res = _while_writing(g, PeekSampler("test", g.hmp, g.read), 0.05, 0.01)
    s = res.sample
    assert s.looked >= 1024 and 0.35 < s.nonzero_share < 0.65
    assert 0.15 < s.rewritten / s.kept < 0.45
    assert s.changed_share is not None and s.changed_share < 0.05
    # stock QEMU: the small deltas put xbzrle among the modelled encodings; this text
    # compresses ~100x, so multifd zstd's first pass and re-sends beat it
    c = encoding.choose_sample(s)
    assert "xbzrle" in c.reason and c.encoding == "zstd", c.reason
    assert res.as_dict()["name"] == "test" and res.detail["calls"] == g.reads


def test_a_guest_that_does_not_write_shows_no_rewrites():
    g = Guest()
    res = asyncio.run(PeekSampler("test", g.hmp, g.read).sample(256, 0.01))
    assert res.sample.rewritten == 0 and res.sample.kept >= 256


def test_a_mostly_zero_guest_gets_more_clusters_until_the_sample_keeps_its_pages():
    """One page in 8 written, as a freshly booted guest: the first 32 clusters show
    ~64 non-zero pages of the 256 asked for, so the first look reads more clusters at
    that share (at most MAX_LOOK times the first batch: 128 here, as many as needed)."""
    g = Guest(every=8)
    res = asyncio.run(PeekSampler("test", g.hmp, g.read).sample(256, 0.01))
    batch = 2 * 256 // 16
    assert batch < res.detail["first_look_calls"] <= MAX_LOOK * batch
    assert res.sample.kept >= 224  # of the 256 asked for: the share drawn varies
    assert res.sample.looked == 16 * res.detail["first_look_calls"]
    dense = asyncio.run(PeekSampler("test", Guest().hmp, Guest().read).sample(256, 0.01))
    assert dense.detail["first_look_calls"] <= batch + 4  # half non-zero: ~enough already
    empty = Guest(every=1 << 30)  # nothing written: nothing more to find
    res = asyncio.run(PeekSampler("test", empty.hmp, empty.read).sample(256, 0.01))
    assert res.detail["first_look_calls"] == batch and res.sample.kept == 0


def test_a_slow_reader_gets_no_more_clusters_than_fit_its_time() -> None:
    """The same sparse guest through a reader as slow as HMP xp on a busy host (50 ms a
    read, 8 in flight): its first batch alone takes TOP_UP_S, so nothing is added."""
    g = Guest(every=8)

    async def slow(gpa: int, size: int) -> bytes:
        await asyncio.sleep(0.05)
        return await g.read(gpa, size)
    res = asyncio.run(PeekSampler("test", g.hmp, slow).sample(256, 0.01))
    assert res.detail["first_look_calls"] == 2 * 256 // 16
    assert res.sample.kept < 256


def _settled_by_the_model(link_rate: float) -> Any:
    """The engine's check (adapt): the model on a 1 GiB guest at ``link_rate``; the
    samples it was asked about are kept."""
    asked: list[encoding.Sample] = []

    async def settled(s: encoding.Sample) -> bool:
        asked.append(s)
        return encoding.rewrites_negligible(
            s, encoding.Context(link_rate=link_rate, guest_ram=64 << 20))
    return settled, asked


def test_a_guest_that_does_not_write_is_decided_at_the_half_way_look():
    g = Guest()
    settled, asked = _settled_by_the_model(1e9 / 8)
    res = asyncio.run(PeekSampler("test", g.hmp, g.read, settled=settled).sample(256, 0.2))
    assert len(asked) == 1 and res.detail.get("settled_at_half_way") is True
    assert res.sample == asked[0] and res.sample.rewritten == 0
    assert res.sample.mid_rewritten is None  # the half-way look is the last
    assert g.reads == res.detail["calls"]
    full = asyncio.run(PeekSampler("test", g.hmp, g.read).sample(256, 0.2))
    first_look = res.detail["first_look_calls"]
    assert full.detail["first_look_calls"] == first_look
    # the kept clusters read once again, not twice
    assert full.detail["calls"] - first_look == 2 * (res.detail["calls"] - first_look)
    assert res.wall_s < full.wall_s - 0.05  # the interval's second half is not waited


def test_a_rewriting_guest_is_looked_at_to_the_end():
    g = Guest()
    settled, asked = _settled_by_the_model(1e9 / 8)
    res = _while_writing(g, PeekSampler("test", g.hmp, g.read, settled=settled), 0.1, 0.005)
    assert len(asked) == 1 and asked[0].rewritten > 0
    assert "settled_at_half_way" not in res.detail
    assert res.sample.mid_rewritten == asked[0].rewritten
    assert res.sample.rewritten >= asked[0].rewritten


def test_a_slow_link_waits_for_the_last_look_even_without_rewrites():
    """The same idle guest over 10 Mbit/s: three rewritten pages of the kept ones (the
    bound when none were seen) would be more than 5 % of what the link sends."""
    g = Guest()
    settled, asked = _settled_by_the_model(10e6 / 8)
    res = asyncio.run(PeekSampler("test", g.hmp, g.read, settled=settled).sample(256, 0.1))
    assert len(asked) == 1 and "settled_at_half_way" not in res.detail
    assert res.sample.mid_rewritten == 0


def _reply(rewritten: int = 300) -> dict[str, Any]:
    part = {"pages": 1000, "codecs": [
        {"codec": "zstd", "bytes-in": 4096000, "bytes-out": 1700000, "cpu-ns": 9000000},
        {"codec": "lz4", "bytes-in": 4096000, "bytes-out": 2000000, "cpu-ns": 4000000}]}
    delta = {"pages": rewritten, "codecs": [
        {"codec": "lz4", "bytes-in": rewritten * PAGE, "bytes-out": rewritten * 90,
         "cpu-ns": 300000}]}
    return {"status": "done", "looked": 8192, "nonzero": 4000, "kept": 4000,
            "rewritten": rewritten, "interval-ms": 500, "changed-share": 0.02,
            "zlib-ratio": 2.4, "first": part, "resend": part, "delta": delta,
            "ram-bytes": 1 << 30, "blocks": 1, "look-ns": 3000000, "cpu-ns": 90000000}


def test_qemu_reply_becomes_the_models_sample():
    s = parse(_reply())
    assert (s.looked, s.nonzero, s.kept, s.rewritten, s.interval) == (8192, 4000, 4000, 300,
                                                                      0.5)
    assert s.first["zstd"].ratio == pytest.approx(4096000 / 1700000)
    assert s.first["lz4"].speed > s.first["zstd"].speed
    c = encoding.choose_sample(s, encoding.Context(delta=True, link_rate=50e6,
                                                   codecs=frozenset({"zstd", "lz4", "plain"})))
    assert c.encoding == "lz4-delta"


def test_qemus_zstd_level_3_timing_chooses_the_level_on_a_link_bound_stream():
    """The patched sampler (0015) times zstd at level 3 too: whole-page rewrites over
    50 MB/s get zstd at level 3 on a host with a CPU idle, 6 % fewer bytes for 30 %
    more CPU; a fast link with half a CPU keeps level 1."""
    reply = _reply(rewritten=40)
    reply["changed-share"] = 0.9
    for part in ("first", "resend"):
        reply[part] = {"pages": 1000, "codecs": [
            *reply[part]["codecs"],
            {"codec": "zstd-3", "bytes-in": 4096000, "bytes-out": 1600000,
             "cpu-ns": 12000000}]}
    s = parse(reply)
    assert s.first["zstd-3"].ratio > s.first["zstd"].ratio
    codecs = frozenset({"zstd", "plain"})
    slow = encoding.choose_sample(s, encoding.Context(link_rate=50e6, codecs=codecs,
                                                      idle_cpus=1.5))
    assert slow.encoding == "zstd" and slow.applied()["multifd-zstd-level"] == "3"
    fast = encoding.choose_sample(s, encoding.Context(link_rate=10e9 / 8, cpus=0.5,
                                                      codecs=codecs, idle_cpus=1.5))
    assert fast.applied().get("multifd-zstd-level") != "3"


class Seq(list[Any]):
    """Successive replies to one command (the last one repeats)."""


class Script:
    """A scripted QMP: answers from a dict of command -> reply (or a Seq of replies)."""

    def __init__(self, replies: dict[str, Any], pid: int | None = None) -> None:
        self.replies = replies
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.pid = pid

    async def cmd(self, command: str, **args: Any) -> Any:
        self.log.append((command, args))
        r = self.replies[command]
        if isinstance(r, Seq):
            return r.pop(0) if len(r) > 1 else r[0]
        if isinstance(r, Exception):
            raise r
        return r


def test_qemu_sampler_polls_until_done_and_reports_a_failure():
    q = Script({"x-calc-ram-sample": {}, "x-query-ram-sample": Seq([
        {"status": "sampling"}, {"status": "sampling"}, _reply()])})
    res = asyncio.run(QemuSampler(q.cmd, seed=5).sample(4000, 0.01))
    assert res.sampler == "qemu" and res.sample.rewritten == 300
    assert q.log[0] == ("x-calc-ram-sample", {"pages": 4000, "interval-ms": 10, "seed": 5})
    bad = Script({"x-calc-ram-sample": {},
                  "x-query-ram-sample": {"status": "failed", "error": "no RAM"}})
    with pytest.raises(VMError, match="no RAM"):
        asyncio.run(QemuSampler(bad.cmd).sample(16, 0.01))


def test_xp_output_is_read_back_as_bytes():
    words = [0x1122334455667788, 0, 0xFF]

    async def hmp(line: str) -> str:
        assert line == "xp /3xg 0x1000"
        return ("0000000000001000: 0x1122334455667788 0x0000000000000000\n"
                "0000000000001010: 0x00000000000000ff\n")

    data = asyncio.run(XpReader(hmp)(0x1000, 24))
    assert data == b"".join(w.to_bytes(8, "little") for w in words)


def test_gpa2hva_answers_and_errors_are_told_apart():
    assert parse_gpa2hva("Host virtual address for 0x100000 (pc.ram) is 0x7f12a0100000\r\n"
                         ) == 0x7F12A0100000
    assert parse_gpa2hva("Memory at address 0xfee00000 is not RAM\r\n") is None
    assert parse_gpa2hva("No memory is mapped at address 0x500000000\r\n") is None


def test_procmem_reads_the_process_mapping_and_sends_the_rest_elsewhere():
    """This process stands in for QEMU: a buffer is its 'guest RAM' at gpa 1 MiB; the
    reader maps it through gpa2hva and reads /proc/self/mem. A range QEMU maps in two
    pieces, and a read outside every range, go to the fallback reader."""
    import ctypes
    import os
    ram = ctypes.create_string_buffer(bytes(random.Random(3).randbytes(1 << 20)))
    base = ctypes.addressof(ram)
    other = 0x100000000  # a second range whose last byte is not where its first says

    async def hmp(line: str) -> str:
        gpa = int(line.split()[1], 16)
        if 0x100000 <= gpa < 0x200000:
            return f"Host virtual address for {gpa:#x} (pc.ram) is {base + gpa - 0x100000:#x}"
        return f"Host virtual address for {gpa:#x} (x) is {0x10000000 + (gpa & 0xfff):#x}"

    fell: list[int] = []

    async def fallback(gpa: int, size: int) -> bytes:
        fell.append(gpa)
        return bytes(size)

    async def go() -> tuple[list[bytes], int]:
        r = ProcMemReader(hmp, os.getpid(), fallback)
        await r.prepare([RamRange(0x100000, 1 << 20, "pc.ram"),
                         RamRange(other, 1 << 20, "x")])
        try:
            before = await r(0x100000 + 8 * PAGE, 16 * PAGE)
            ram[8 * PAGE] = ram.raw[8 * PAGE] ^ 0xFF  # the guest writes a byte
            return [before, await r(0x100000 + 8 * PAGE, 16 * PAGE),
                    await r(other, PAGE), await r(0x300000, PAGE)], r.fallbacks
        finally:
            r.close()

    (before, after, split, outside), fallbacks = asyncio.run(go())
    want = ram.raw[8 * PAGE:24 * PAGE]  # as the 'guest' left it
    assert after == want and before[1:] == want[1:] and before[0] != want[0]
    assert fell == [other, 0x300000] and split == outside == bytes(PAGE)
    assert fallbacks == 2


def _schema(values: list[str]) -> list[dict[str, Any]]:
    return [{"name": "query-migrate-parameters", "meta-type": "command", "ret-type": "7"},
            {"name": "7", "meta-type": "object",
             "members": [{"name": "multifd-compression", "type": "9"}]},
            {"name": "9", "meta-type": "enum", "values": values}]


def _qemu(commands: set[str], compression: list[str], sample: dict[str, Any] | None = None,
          params: dict[str, Any] | None = None) -> Script:
    replies: dict[str, Any] = {
        "query-commands": [{"name": c} for c in commands],
        "query-cpus-fast": [{"cpu-index": 0}],
        "query-memory-size-summary": {"base-memory": 1 << 30},
        "query-migrate-parameters": params or {"downtime-limit": 300},
        "query-qmp-schema": _schema(compression)}
    if sample is not None:
        replies["x-calc-ram-sample"] = {}
        replies["x-query-ram-sample"] = sample
    return Script(replies)


def _plan(sets: dict[str, str] | None = None) -> Plan:
    sets = sets or {}
    return Plan(uri="tcp:127.0.0.1:4444", settings=tuple(merge("livemig", sets).items()),
                explicit=frozenset(sets), bandwidth=50 << 20).validate()


def test_codecs_come_from_the_qemus_schema():
    q = _qemu(set(), ["none", "zlib", "zstd", "qpl"])
    assert asyncio.run(multifd_codecs(q)) == frozenset({"plain", "zstd"})


def test_stock_qemu_gets_auto_converge_instead_of_the_patched_throttle():
    q = _qemu(set(), ["none", "zstd"])
    plan = _plan({"encoding": "zstd"})
    a = asyncio.run(adapt(q, plan, Hints(), EventStream()))
    assert a.plan.wanted["throttle"] == "auto-converge" and plan.wanted["throttle"] == "converge"
    assert [n["setting"] for n in a.notes] == ["throttle", "downtime-ramp"]
    assert a.plan.wanted["downtime-ramp"] == "off"
    assert a.plan.wanted["multifd-compression"] == "zstd"
    kept = asyncio.run(adapt(q, _plan({"throttle": "off", "encoding": "zstd"}), Hints(),
                             EventStream()))
    assert kept.plan.wanted["throttle"] == "off" and not kept.notes


def test_the_patched_qemu_samples_itself_and_gets_a_second_plan():
    q = _qemu({"x-calc-ram-sample", "set-cpu-throttle"}, ["none", "zstd", "lz4"], _reply(),
              {"downtime-limit": 300, encoding.DELTA_KEY: 0})
    plan = _plan()
    a = asyncio.run(adapt(q, plan, Hints(host_available=8 << 30), EventStream()))
    assert a.encoding is not None and a.encoding["encoding"] == "lz4-delta"
    assert a.encoding["sampler"]["name"] == "qemu"
    assert a.plan.wanted["multifd-compression"] == "lz4" and a.plan is not plan
    assert "multifd-compression" not in plan.wanted  # the first plan is untouched
    assert a.plan.wanted["throttle"] == "converge"


def test_the_context_is_read_while_the_sample_waits_and_a_failed_sample_says_so():
    """What the model needs to know of the QEMU (its codecs: query-qmp-schema, ~0.1 s)
    is asked while QEMU's sampling thread runs, not before it: the user waits for the
    sample before the migration starts. A sample that fails is a one-line error, and
    the context's queries are not left running."""
    q = _qemu({"x-calc-ram-sample", "set-cpu-throttle"}, ["none", "zstd", "lz4"],
              Seq([{"status": "sampling"}, _reply()]),
              {"downtime-limit": 300, encoding.DELTA_KEY: 0})
    asyncio.run(adapt(q, _plan(), Hints(host_available=8 << 30), EventStream()))
    names = [c for c, _ in q.log]
    assert names.index("x-calc-ram-sample") < names.index("query-qmp-schema") \
        < names.index("x-query-ram-sample")
    q.replies["x-query-ram-sample"] = {"status": "failed", "error": "no RAM"}

    async def failing() -> set[asyncio.Task[Any]]:
        with pytest.raises(VMError, match=r"page sample \(qemu\): .*no RAM"):
            await adapt(q, _plan(), Hints(host_available=8 << 30), EventStream())
        return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

    assert not asyncio.run(failing())


def _switching_qemu(sample: Any = None) -> Script:
    q = _qemu({"x-calc-ram-sample", "set-cpu-throttle"}, ["none", "zstd", "lz4"],
              sample or _reply(), _SWITCH_PARAMS)
    q.replies["query-migrate-capabilities"] = [
        {"capability": "multifd", "state": False}, {"capability": SWITCH_CAP, "state": False}]
    q.replies["migrate-set-parameters"] = {}
    return q


_SWITCH_PARAMS = {"downtime-limit": 300, encoding.DELTA_KEY: 0, "multifd-compression": "none",
                  "multifd-zstd-level": 1}


def test_ends_that_switch_codecs_start_at_once_and_choose_beside_the_first_pass():
    """With x-multifd-compression-switch on both ends (patches 0012, 0013) the second
    plan starts the stream with zstd keeping the delta cache, and no sample is taken
    before the migration; the deferred choice samples and switches: a guest that
    rewrites small parts gets lz4 (delta encoding against the same cache) at once
    where lz4's speed decides its first pass (two CPUs, 400 MiB/s), or keeps
    zstd until its first pass is over where the link does (zstd+delta: the executor
    switches then); one that does not rewrite keeps zstd and drops the cache."""
    for rewritten, link, chosen, sets in (
            (300, 400 << 20, "lz4-delta", [{"multifd-compression": "lz4"}]),
            (300, 12 << 20, "zstd+delta", []),
            (0, 50 << 20, "zstd", [{encoding.DELTA_KEY: 0}])):
        q = _switching_qemu(_reply(rewritten))
        events = EventStream()
        plan = dataclasses.replace(_plan(), bandwidth=link)
        a = asyncio.run(adapt(q, plan, Hints(host_available=8 << 30, dst_switch=True,
                                             cpus=2.0), events))
        assert a.deferred is not None and a.encoding is not None and a.encoding["deferred"]
        assert not [c for c in q.log if c[0] == "x-calc-ram-sample"]  # nothing sampled yet
        assert a.plan.wanted["multifd-compression"] == "zstd" and a.plan.wanted[SWITCH_CAP] == "on"
        assert a.plan.wanted[encoding.DELTA_KEY] == "1024M"  # every page of the 1 GiB guest
        told = PolicyExecutor(PolicyConfig(), QmpActuator(q.cmd), lambda w, d: None)
        rec = asyncio.run(switch(q, a.deferred, a.encoding, _SWITCH_PARAMS,
                                 events, told))
        assert rec["encoding"] == chosen and rec["started_with"] == "zstd"
        # the switch after the first pass is the executor's, for zstd+delta only
        assert [p.name for p in told.policies] == (
            ["after-first-pass"] if chosen == "zstd+delta" else [])
        assert rec["switched"] is bool(sets)
        assert [args for c, args in q.log if c == "migrate-set-parameters"] == sets
        assert [e["event"] for e in events.log] == [
            "encoding deferred", "encoding chosen",
            "encoding switched" if sets else "encoding kept"]


def test_a_whole_page_choice_arms_the_converge_throttles_delta_fallback():
    """A sample that saw a few small rewrites (3 pages, 2 % of each changed), too few
    for deltas to pay now, chooses zstd, keeps the cache the stream started with and
    arms the converge throttle's fallback to lz4 deltas against it; a sample without
    rewrites drops the cache and arms the fallback with a new cache of the start's
    size; a sample of whole-page rewrites arms nothing, and neither does a run
    without the converge throttle (nothing would use it)."""
    def run(sample: dict[str, Any], cfg: PolicyConfig) -> tuple[Script, dict[str, Any],
                                                              PolicyExecutor, EventStream]:
        q = _switching_qemu(sample)
        events = EventStream()
        plan = dataclasses.replace(_plan(), bandwidth=50 << 20)
        a = asyncio.run(adapt(q, plan, Hints(host_available=8 << 30, dst_switch=True,
                                             cpus=2.0), events))
        assert a.deferred is not None and a.encoding is not None
        told = PolicyExecutor(cfg, QmpActuator(q.cmd), lambda w, d: None)
        rec = asyncio.run(switch(q, a.deferred, a.encoding, _SWITCH_PARAMS, events, told))
        return q, rec, told, events

    def sets(q: Script) -> list[Any]:
        return [args for c, args in q.log if c == "migrate-set-parameters"]

    converge = PolicyConfig(throttle="converge")
    q, rec, told, events = run(_reply(3), converge)
    assert rec["encoding"] == "zstd" and encoding.DELTA_KEY not in str(sets(q))
    assert "3 rewritten pages, a median 2% of each" in rec["delta_fallback"]
    assert "the kept cache" in rec["delta_fallback"] and rec["delta_cache_kept"] is True
    assert told.converge is not None and told.converge._fallback is not None
    assert told.converge._fallback[:2] == ("lz4", 0)
    assert "delta fallback armed" in [e["event"] for e in events.log]

    q, rec, told, events = run(_reply(0), converge)
    assert rec["encoding"] == "zstd" and sets(q) == [{encoding.DELTA_KEY: 0}]
    assert told.converge is not None and told.converge._fallback is not None
    method, cache, _ = told.converge._fallback
    assert method == "lz4" and cache > 0 and rec["delta_cache_kept"] is False
    assert f"new {cache >> 20} MiB cache" in rec["delta_fallback"]
    assert "no rewrite" in rec["delta_fallback"]

    whole = _reply(rewritten=40)
    whole["changed-share"] = 0.9
    whole["delta"]["codecs"][0]["bytes-out"] = 40 * PAGE  # whole pages: the delta does not pay
    q, rec, told, _ = run(whole, converge)
    assert rec["encoding"].startswith("zstd") and "delta_fallback" not in rec
    assert {encoding.DELTA_KEY: 0} in [{k: v for k, v in a.items() if k == encoding.DELTA_KEY}
                                       for a in sets(q)]
    assert told.converge is not None and told.converge._fallback is None

    for sample, cfg in ((_reply(0), PolicyConfig()), (_reply(3), PolicyConfig())):
        q, rec, told, _ = run(sample, cfg)
        assert rec["encoding"] == "zstd" and "delta_fallback" not in rec
        assert sets(q) == [{encoding.DELTA_KEY: 0}]


def _whole_reply() -> dict[str, Any]:
    """A sample of whole-page rewrites: zstd, nothing armed by the first choice."""
    whole = _reply(rewritten=40)
    whole["changed-share"] = 0.9
    whole["delta"]["codecs"][0]["bytes-out"] = 40 * PAGE
    return whole


def _second_look(later: dict[str, Any], cfg: PolicyConfig | None = None
                 ) -> tuple[dict[str, Any], PolicyExecutor, Script]:
    """The switch on a whole-page sample, then a second look that sees ``later``."""
    q = _switching_qemu(Seq([_whole_reply(), later]))
    q.replies["query-migrate"] = Seq([{"status": "active", "ram": {"dirty-sync-count": 2}}])
    events = EventStream()
    plan = dataclasses.replace(_plan(), bandwidth=50 << 20)
    a = asyncio.run(adapt(q, plan, Hints(host_available=8 << 30, dst_switch=True, cpus=2.0),
                          events))
    assert a.deferred is not None and a.encoding is not None
    told = PolicyExecutor(cfg or PolicyConfig(throttle="converge"), QmpActuator(q.cmd),
                          lambda w, d: None)

    async def run() -> dict[str, Any]:
        assert a.deferred is not None
        beside = Beside.start(q, a.deferred, a.encoding or {}, _SWITCH_PARAMS, events, told)
        await asyncio.wait({beside.second})
        return await beside.outcome(a.encoding, events)

    return asyncio.run(run()), told, q


def test_a_second_look_after_the_first_pass_arms_the_fallback_for_a_guest_turned_small_writer():
    """A guest sampled rewriting whole pages (zstd, nothing armed) is looked at again
    once the first pass is over. Now rewriting small parts of its pages, enough for
    the sample to choose deltas, the stream goes to lz4 with a new delta cache of the
    start's size at once (patch 0019) and the converge throttle measures two rounds
    of it; rewriting a few, too few for deltas yet, it gets the converge throttle's
    fallback with a new cache. Still rewriting whole pages, nothing is armed; without
    the converge throttle, no second look is taken."""
    rec, told, q = _second_look(_reply(rewritten=300))
    assert rec["encoding"].startswith("zstd") and "delta_fallback" not in rec
    look = rec["second_look"]
    assert look["samples"] == 300 and look["would_choose"] in ("lz4-delta", "zstd+delta")
    assert look["switched_to"] == "lz4 with a new 1024 MiB delta cache", look
    assert q.log[-1] == ("migrate-set-parameters", {encoding.DELTA_KEY: 1024 << 20,
                                                    "multifd-compression": "lz4"})
    assert told.converge is not None and told.converge._fallback is None
    assert told.converge._measure_rounds == 2

    rec, told, q = _second_look(_reply(rewritten=3))
    look = rec["second_look"]
    assert look["armed"] is True and look["would_choose"] == "zstd", look
    assert "new 1024 MiB cache" in look["delta_fallback"]
    assert told.converge is not None and told.converge._fallback is not None
    assert told.converge._fallback[:2] == ("lz4", 1024 << 20)
    assert sum(1 for c, _ in q.log if c == "x-calc-ram-sample") == 2

    rec, told, _ = _second_look(_whole_reply())
    assert rec["second_look"]["armed"] is False
    assert told.converge is not None and told.converge._fallback is None

    rec, told, q = _second_look(_reply(rewritten=300), PolicyConfig())
    assert "second_look" not in rec and told.converge is None
    assert sum(1 for c, _ in q.log if c == "x-calc-ram-sample") == 1


def test_no_second_look_where_the_first_choice_armed_a_fallback_or_kept_deltas():
    first = {"applied": {encoding.DELTA_KEY: "256M"}}
    told = PolicyExecutor(PolicyConfig(throttle="converge"), QmpActuator(Script({}).cmd),
                          lambda w, d: None)
    assert second_look.wanted({"switched": True, "encoding": "zstd"}, first, told) == 256 << 20
    assert second_look.wanted({"switched": True, "encoding": "zstd-3"}, first, told) > 0
    for rec in ({"switched": True, "encoding": "zstd", "delta_fallback": "armed"},
                {"switched": True, "encoding": "lz4-delta"},
                {"switched": True, "encoding": "zstd+delta"},
                {"switched": False, "encoding": "zstd"}):
        assert second_look.wanted(rec, first, told) == 0, rec
    assert second_look.wanted({"switched": True, "encoding": "zstd"},
                              {"applied": {encoding.DELTA_KEY: "0"}}, told) == 0
    assert second_look.wanted({"switched": True, "encoding": "zstd"}, first, None) == 0


def test_the_second_look_stops_when_the_migration_ends_first():
    q = Script({"query-migrate": {"status": "completed"}})
    told = PolicyExecutor(PolicyConfig(throttle="converge"), QmpActuator(q.cmd),
                          lambda w, d: None)

    async def never(_: EventStream) -> tuple[dict[str, Any], dict[str, str]]:
        raise AssertionError("no sample once the migration ended")

    async def run() -> dict[str, Any] | None:
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        done.set_result({"switched": True, "encoding": "zstd"})
        return await second_look.look_again(q, never, done,
                                            {"applied": {encoding.DELTA_KEY: "64M"}},
                                            told, EventStream())

    assert asyncio.run(run()) is None


def test_a_destination_that_cannot_switch_gets_the_choice_before_the_migration():
    q = _switching_qemu()
    for dst_switch in (False, None):
        a = asyncio.run(adapt(q, _plan(), Hints(host_available=8 << 30,
                                                 dst_switch=dst_switch), EventStream()))
        assert a.deferred is None and a.encoding is not None
        assert a.encoding["encoding"] == "lz4-delta" and SWITCH_CAP not in a.plan.wanted
    assert [c for c in q.log if c[0] == "x-calc-ram-sample"]
    # a codec given explicitly is not chosen at all, before or during the migration
    a = asyncio.run(adapt(q, _plan({"multifd-compression": "zstd"}),
                          Hints(dst_switch=True), EventStream()))
    assert a.deferred is None and SWITCH_CAP not in a.plan.wanted


def test_only_the_codec_settings_change_mid_stream():
    start = {**encoding.ENCODINGS["lz4"], **START_EXTRA}
    assert changes(start, encoding.ENCODINGS["zstd"]) == ({"multifd-compression": "zstd"}, [])
    assert changes(start, encoding.ENCODINGS["lz4-delta"]) == ({encoding.DELTA_KEY: "256M"}, [])
    assert changes(start, start) == ({}, [])
    assert changes(start, encoding.ENCODINGS["xbzrle"])[1] == [
        "multifd", "xbzrle", "xbzrle-cache-size"]


def test_a_refused_or_impossible_switch_keeps_the_start_and_says_why():
    q = _switching_qemu()
    q.replies["migrate-set-parameters"] = VMError("src: migrate-set-parameters: no")

    async def chosen(name: str, _ev: EventStream) -> tuple[dict[str, Any], dict[str, str]]:
        return {"encoding": name}, encoding.ENCODINGS[name]

    first = {"started_with": "lz4", "applied": {**encoding.ENCODINGS["lz4"], **START_EXTRA}}
    rec = asyncio.run(switch(q, lambda ev: chosen("zstd", ev), first, _SWITCH_PARAMS,
                             EventStream()))
    assert rec["switched"] is False and "QEMU refused" in rec["kept_because"]
    rec = asyncio.run(switch(q, lambda ev: chosen("xbzrle", ev), first, _SWITCH_PARAMS,
                             EventStream()))
    assert rec["switched"] is False and "cannot change" in rec["kept_because"]
    assert len([c for c in q.log if c[0] == "migrate-set-parameters"]) == 1


def test_a_sample_still_running_when_the_migration_ends_is_stopped_and_reported():
    q = _switching_qemu()
    engine = Engine(q, q, _plan(), encoding={"encoding": "lz4", "deferred": True})  # type: ignore[arg-type]

    async def ended() -> tuple[dict[str, Any], bool]:
        never = asyncio.Event()

        async def sample() -> dict[str, Any]:
            await never.wait()
            return {}

        async def second() -> dict[str, Any] | None:
            await never.wait()
            return None

        engine._beside = Beside(asyncio.ensure_future(sample()),
                                asyncio.ensure_future(second()))
        await asyncio.sleep(0)
        tasks = (engine._beside.switch, engine._beside.second)
        await engine._switch_done()
        return engine.encoding or {}, all(t.cancelled() for t in tasks)

    enc, cancelled = asyncio.run(ended())
    assert cancelled and enc["switched"] is False and "second_look" not in enc
    assert enc["kept_because"] == "the migration ended before the sample"


def test_explicit_stream_settings_are_not_overridden():
    q = _qemu({"x-calc-ram-sample"}, ["none", "zstd"], _reply())
    a = asyncio.run(adapt(q, _plan({"multifd-compression": "zstd"}), Hints(), EventStream()))
    assert a.encoding is not None and a.encoding["encoding"] is None
    assert not [c for c in q.log if c[0] == "x-calc-ram-sample"]


class DirtyRateQmp:
    """calc-dirty-rate / query-dirty-rate as QEMU answers them (measuring, then
    measured), or a QEMU that refuses the command."""

    def __init__(self, rate_mib: int = 300, refuse: bool = False) -> None:
        self.rate_mib = rate_mib
        self.refuse = refuse
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.queries = 0

    async def __call__(self, command: str, **args: Any) -> Any:
        self.calls.append((command, args))
        if self.refuse:
            raise VMError(f"src: {command}: The command {command} has not been found")
        if command == "calc-dirty-rate":
            return {}
        self.queries += 1
        status = "measured" if self.queries > 1 else "measuring"
        return {"status": status, "dirty-rate": self.rate_mib, "calc-time": 100,
                "calc-time-unit": "millisecond", "mode": "page-sampling"}


def test_short_rate_is_qemus_page_sampling_estimate_over_a_window_in_ms():
    q = DirtyRateQmp(300)

    async def go() -> Any:
        s = ShortRate(q)
        await s.start()
        return s, await s.result()

    s, got = asyncio.run(go())
    assert got == (300 * (1 << 20), 0.1)
    assert q.calls[0] == ("calc-dirty-rate", {"calc-time": 100,
                                              "calc-time-unit": "millisecond",
                                              "mode": "page-sampling",
                                              "sample-pages": 4096})
    assert ShortRate(q, 64 << 30).per_gib == 1024  # 65536 pages hashed at most
    assert ShortRate(q, 4 << 40).per_gib == 128  # QEMU's minimum
    assert q.queries == 2 and "300 MiB/s over 100 ms" in s.note


def test_qemus_window_runs_in_the_half_way_wait_after_the_callers_own_work(monkeypatch):
    """The window starts after the first look's codec timings and the caller's
    ``quiet`` (the engine's context queries): on a host with no core to spare, those
    bursts beside QEMU's first hashing pass emptied the window. It runs while the
    half-way look waits (one after the other, the two made a sample 0.33 s), and the
    half-way reads come no sooner than FIRST_PASS_S after its start."""
    g = Guest()
    q = DirtyRateQmp(40)
    order: list[str] = []
    reads_at_calc: list[int] = []
    read_times: list[tuple[int, float]] = []
    calc_at: list[float] = []
    measure = encoding.measure_codecs

    def timed_codecs(*args: Any, **kw: Any) -> Any:
        out = measure(*args, **kw)
        order.append("codecs")
        return out
    monkeypatch.setattr(encoding, "measure_codecs", timed_codecs)

    async def quiet() -> None:
        await asyncio.sleep(0.02)
        order.append("quiet")

    async def qmp(command: str, **args: Any) -> Any:
        if command == "calc-dirty-rate":
            order.append(command)
            reads_at_calc.append(g.reads)
            calc_at.append(time.monotonic())
        return await q(command, **args)

    async def read(gpa: int, size: int) -> bytes:
        read_times.append((g.reads, time.monotonic()))
        return await g.read(gpa, size)

    sampler = PeekSampler("test", g.hmp, read, qmp=qmp)
    sampler.quiet = quiet
    res = asyncio.run(sampler.sample(256, 0.02))
    assert sorted(order[:2]) == ["codecs", "quiet"] and order[2] == "calc-dirty-rate"
    first = res.detail["first_look_calls"]
    assert reads_at_calc == [first]  # the first look only: the half-way one waits
    half_way = [t for n, t in read_times if n >= first]
    assert half_way and min(half_way) >= calc_at[0] + FIRST_PASS_S
    assert res.sample.short_rate == 40 * (1 << 20)
    assert res.sample.mid_rewritten is not None


def _peek_qemu(g: Guest) -> Script:
    """A stock QEMU (no sampler of its own) over ``g``'s RAM, for the peek samplers,
    whose short-window count reads 0 MiB/s."""
    q = _qemu(set(), ["none", "zstd"])
    q.replies.update({
        "human-monitor-command": asyncio.run(g.hmp("info mtree -f")), "calc-dirty-rate": {},
        "query-dirty-rate": {"status": "measured", "dirty-rate": 0, "calc-time": 100},
        "query-memory-size-summary": {"base-memory": len(g.ram)}})
    return q


def test_the_engines_window_waits_for_its_queries_not_for_the_idle_meter():
    """adapt's context read ends with the idle-CPU meter sleeping out its window; the
    short window waits for the context's queries only (waiting for the meter too made
    a 6 GiB guest's sample 0.49 s instead of 0.40)."""
    g = Guest()
    q = _peek_qemu(g)
    reads = iter([(0.0, 0.0, 2), (1.0, 2.0, 2)])

    def idle() -> tuple[float, float, int]:
        if q.log:  # the meter's first reading, when it is made, comes before adapt
            q.log.append(("idle read", {}))
        return next(reads)

    hints = Hints(peek=g.read, idle=IdleMeter(idle, window=0.6))
    a = asyncio.run(adapt(q, _plan(), hints, EventStream()))
    assert a.encoding is not None and a.encoding["context"]["idle_cpus"] == 1.0
    order = [c for c, _ in q.log if c in ("query-qmp-schema", "calc-dirty-rate",
                                           "idle read")]
    assert order == ["query-qmp-schema", "calc-dirty-rate", "idle read"]


@pytest.mark.parametrize("monitor_reads", [False, True])
def test_the_engines_queries_run_beside_reads_that_do_not_use_the_monitor(
        monkeypatch: pytest.MonkeyPatch, monitor_reads: bool) -> None:
    """A sampler reading through /proc/PID/mem leaves the monitor free: the context's
    queries (query-qmp-schema) run beside its first look instead of after it, so the
    window can start sooner; a sampler reading through the monitor keeps them after
    its first look."""
    from livemig.engine import adapt as adapt_mod

    g = Guest()
    q = _peek_qemu(g)
    reads_at_schema: list[int] = []
    cmd = q.cmd

    async def logged(command: str, **args: Any) -> Any:
        if command == "query-qmp-schema":
            reads_at_schema.append(g.reads)
        return await cmd(command, **args)

    async def slow_read(gpa: int, size: int) -> bytes:
        await asyncio.sleep(0.001)
        return await g.read(gpa, size)

    def sampler_for(src: Any, mode: str, commands: set[str], hints: Hints,
                    before_migrate: bool = False) -> Any:
        return PeekSampler("test", g.hmp, slow_read, qmp=src.cmd,
                           monitor_reads=monitor_reads), lambda: None
    monkeypatch.setattr(adapt_mod, "sampler_for", sampler_for)
    monkeypatch.setattr(q, "cmd", logged)
    a = asyncio.run(adapt(q, _plan(), Hints(), EventStream()))
    assert a.encoding is not None and a.encoding["sampler"]["name"] == "test"
    first = a.encoding["sampler"]["first_look_calls"]
    if monitor_reads:
        assert reads_at_schema == [first]
    else:
        assert reads_at_schema[0] < first


def test_a_qemu_that_refuses_the_count_leaves_the_sample_without_it():
    g = Guest()
    q = DirtyRateQmp(refuse=True)
    res = asyncio.run(PeekSampler("test", g.hmp, g.read, qmp=q).sample(256, 0.02))
    assert res.sample.short_rate is None and res.sample.mid_rewritten is not None
    assert "refused" in res.detail["short_rate"]
    # and one that answers puts it in the sample, beside the half-way look
    res = asyncio.run(PeekSampler("test", g.hmp, g.read, qmp=DirtyRateQmp(40)).sample(256, 0.02))
    assert res.sample.short_rate == 40 * (1 << 20) and res.sample.short_interval == 0.1


def test_the_engine_ends_an_idle_guests_peek_sample_at_its_half_way_look():
    """adapt hands the peek samplers the model's check, with the context it reads
    while they wait: an idle 64 MiB guest at 50 MiB/s is decided at the half-way look;
    the same guest at 1 MiB/s (a first pass of half a minute) is looked at to the end."""
    g = Guest()
    a = asyncio.run(adapt(_peek_qemu(g), _plan(), Hints(peek=g.read), EventStream()))
    assert a.encoding is not None
    assert a.encoding["sampler"]["name"] == "libvirt-peek"
    assert a.encoding["sampler"].get("settled_at_half_way") is True
    slow = Plan(uri="tcp:127.0.0.1:4444", settings=tuple(merge("livemig", {}).items()),
                bandwidth=1 << 20).validate()
    b = asyncio.run(adapt(_peek_qemu(g), slow, Hints(peek=g.read), EventStream()))
    assert b.encoding is not None
    assert "settled_at_half_way" not in b.encoding["sampler"]
