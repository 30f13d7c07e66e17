"""The RAM comparison's pause budget (``ram-check-budget``): all of RAM when it fits,
else random ranges until the budget is spent, with the share covered in the verdict.
Scripted QMP ends (:mod:`fakeqmp`): their digest is SHA-256 of the bytes, so a
changed byte is a changed chunk."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

import livemig.engine.verify as verify
from fakeqmp import FakeEnd
from livemig.engine.verify import compare_digests, parse_ramblocks
from livemig.errors import UsageError, VMError
from livemig.report import _ram_note
from livemig.settings import LIVEMIG_SETTINGS, ram_check_budget_s

MIB = 1 << 20

def _row(name: str, psize: str, offset: int, used: int, total: int, ro: str) -> str:
    """One line as QEMU 10.2's ram_block_format() prints it."""
    return (f"{name:>24} {psize:>8}  0x{offset:016x} 0x{used:016x} 0x{total:016x} "
            f"0x{0x7F3A40000000:016x} {ro:>3}\n")


INFO_RAMBLOCK = (f"{'Block Name':>24} {'PSize':>8}  {'Offset':>18} {'Used':>18} "
                 f"{'Total':>18} {'HVA':>18} {'RO':>3}\n"
                 + _row("pc.ram", "4 KiB", 0, 4 << 30, 4 << 30, "rw")
                 + _row("vga.vram", "4 KiB", 0x100080000, 16 << 20, 16 << 20, "rw")
                 + _row("/rom@etc/acpi/tables", "4 KiB", 0x101100000, 0x20000, 0x200000, "ro")
                 + _row("ram-big", "2 MiB", 0x101400000, 0, 1 << 30, "rw"))


def test_info_ramblock_is_read_as_names_and_used_sizes() -> None:
    assert parse_ramblocks(INFO_RAMBLOCK) == [
        ("pc.ram", 4 << 30), ("vga.vram", 16 * MIB), ("/rom@etc/acpi/tables", 0x20000),
        ("ram-big", 0)]


def _ends(ram_mib: int = 8) -> tuple[FakeEnd, FakeEnd]:
    base = {"pc.ram": bytearray(ram_mib * MIB), "vga.vram": bytearray(MIB)}
    for i in range(0, ram_mib * MIB, 4096):
        base["pc.ram"][i] = i >> 12 & 0xFF
    cmds = {"x-query-ram-digest"}
    src = FakeEnd("src", status="postmigrate", commands=cmds,
                  ram={k: bytearray(v) for k, v in base.items()})
    dst = FakeEnd("dst", status="paused", commands=cmds,
                  ram={k: bytearray(v) for k, v in base.items()})
    return src, dst


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe and the sampled ranges 1 MiB, and every guest "slow" enough to be
    probed, so that an 8 MiB scripted guest behaves as a large one would."""
    monkeypatch.setattr(verify, "PROBE", MIB)
    monkeypatch.setattr(verify, "SPAN", MIB)
    monkeypatch.setattr(verify, "SLOW_S_PER_BYTE", 1.0)


def _whole_calls(end: FakeEnd) -> int:
    return sum(1 for a in end.called("x-query-ram-digest") if "block" not in a)


def test_no_budget_or_a_small_guest_is_compared_whole_without_a_probe() -> None:
    for budget in (None, 10.0):  # 9 MiB at 0.5 s/GiB fits 10 s unprobed
        src, dst = _ends()
        v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=budget))
        assert v.result == "ok" and v.coverage is None
        assert src.called("x-query-ram-digest") == [{"chunk-size": MIB, "threads": 2}]
        assert "coverage" not in v.as_dict()


def test_ram_that_fits_the_budget_once_timed_is_compared_whole(small_ranges: None) -> None:
    src, dst = _ends()
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=60.0))
    assert v.result == "ok" and v.coverage is None and v.bytes_compared == 9 * MIB
    assert _whole_calls(src) == 1 and _whole_calls(dst) == 1
    probe = src.called("x-query-ram-digest")[0]
    assert probe == {"chunk-size": MIB, "block": "pc.ram", "offset": 0, "length": MIB,
                     "threads": 2}


def test_over_budget_ranges_at_random_and_the_share_covered_is_said(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _ends()
    monkeypatch.setattr(verify, "_now", _clock(per_call=0.01))
    # a budget for the probe and three more 1 MiB ranges: never all of RAM
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=0.085, seed=3))
    assert v.result == "ok" and _whole_calls(src) == 0 and _whole_calls(dst) == 0
    assert 2 * MIB <= v.bytes_compared < 9 * MIB
    assert v.coverage == pytest.approx(v.bytes_compared / (9 * MIB))
    d = v.as_dict()
    assert d["coverage"] == round(v.coverage, 4) and d["budget_s"] == 0.085
    assert "% of RAM in ranges at random" in _ram_note("ok", d)
    ranged = [(a["block"], a["offset"]) for a in src.called("x-query-ram-digest")]
    assert ranged[0] == ("pc.ram", 0) and len(set(ranged)) == len(ranged)


def test_a_difference_in_a_compared_range_is_found_and_named(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _ends()
    dst.ram["pc.ram"][0x1234] ^= 0x40  # in the probe: always compared
    monkeypatch.setattr(verify, "_now", _clock(per_call=0.01))
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=0.08, seed=1))
    assert v.result == "mismatch" and v.coverage is not None and v.coverage < 1
    assert v.first_mismatches == ("0x1000",)
    # a destination known to differ is not compared further: the source resumes sooner
    ranged = [a for a in src.called("x-query-ram-digest") if a["chunk-size"] == MIB]
    assert ranged == [{"chunk-size": MIB, "block": "pc.ram", "offset": 0, "length": MIB,
                       "threads": 2}]


def test_a_difference_outside_the_ranges_is_the_price_of_the_budget(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the budget gives up, said by the verdict's coverage: a page the ranges did
    not reach. (A corruption of a share of all pages or of a whole block is found.)"""
    src, dst = _ends()
    monkeypatch.setattr(verify, "_now", _clock(per_call=0.01))
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=0.05, seed=1))
    seen = {(a["block"], a["offset"]) for a in src.called("x-query-ram-digest")}
    unseen = next(off for off in range(0, 8 * MIB, MIB) if ("pc.ram", off) not in seen)
    src2, dst2 = _ends()
    dst2.ram["pc.ram"][unseen + 8] ^= 1
    v2 = asyncio.run(compare_digests(src2, dst2, chunk=MIB, budget=0.05, seed=1))
    assert v.result == v2.result == "ok" and v2.coverage == v.coverage < 1
    dst2.ram["pc.ram"][::4096] = bytes(len(dst2.ram["pc.ram"][::4096]))  # every page
    v3 = asyncio.run(compare_digests(src2, dst2, chunk=MIB, budget=0.05, seed=1))
    assert v3.result == "mismatch"


def test_a_block_the_destination_lacks_is_a_mismatch_in_the_ranges(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = _ends()
    src.ram["extra"] = bytearray(4 * MIB)  # ranges of it are all that fit
    monkeypatch.setattr(verify, "_now", _clock(per_call=0.001))

    async def no_extra(command: str, _orig=dst.cmd, **args: object) -> object:
        if command == "x-query-ram-digest" and args.get("block") == "extra":
            raise verify.VMError("dst: RAM block 'extra' not found")
        return await _orig(command, **args)

    dst.cmd = no_extra  # type: ignore[method-assign]
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=1.0, seed=2))
    assert v.result == "mismatch"
    assert "extra: missing on the destination" in v.first_mismatches


def _clock(per_call: float):
    """A monotonic clock that advances ``per_call`` at every reading: the digest's
    timing without depending on this host's speed."""
    t = [0.0]

    def now() -> float:
        t[0] += per_call
        return t[0]
    return now


def test_the_budget_setting() -> None:
    kind = LIVEMIG_SETTINGS["ram-check-budget"].kind
    assert kind("auto") == "auto" and kind("250") == 250 and kind("0") == 0
    for bad in ("-1", "x", "nan"):
        with pytest.raises((ValueError, UsageError)):
            kind(bad)
    assert ram_check_budget_s({"ram-check-budget": "auto", "max-downtime": 800}) == 0.8
    assert ram_check_budget_s({"ram-check-budget": 250, "max-downtime": 800}) == 0.25
    assert ram_check_budget_s({"ram-check-budget": 0}) is None


def test_small_blocks_do_not_cut_the_sampled_comparison_short(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ROM's range costs a call and hardly any bytes: timed per byte, it made every
    range after it look too long for the budget (an 8 GiB guest: 4 % of its RAM
    compared in 71 ms of a 1 s budget). Calls and bytes are timed apart."""
    clock = [0.0]
    monkeypatch.setattr(verify, "_now", lambda: clock[0])
    for seed in range(4):
        src, dst = _ends()
        for i in range(4):
            src.ram[f"rom{i}"] = bytearray(4096)
            dst.ram[f"rom{i}"] = bytearray(4096)
        for end in (src, dst):
            orig = end.cmd

            async def timed(command: str, _orig=orig, **args: object) -> object:
                if command == "x-query-ram-digest":  # 2 ms a call, 10 ms a MiB
                    clock[0] += 0.002 + int(args.get("length", 9 * MIB)) / MIB * 0.01
                return await _orig(command, **args)

            end.cmd = timed  # type: ignore[method-assign]
        v = asyncio.run(compare_digests(src, dst, chunk=4096, budget=0.15, seed=seed))
        assert v.result == "ok" and v.coverage is not None
        assert v.coverage > 0.4, (seed, v.coverage)  # ~6 of 9 MiB fit 0.15 s


def test_digest_threads_follow_the_vcpus_and_fall_back() -> None:
    """Each end digests with one thread per vCPU of the paused guest (at least two);
    a QEMU built before patch 0017 refuses 'threads' and is asked again without."""
    src, dst = _ends()
    src.vcpus = 4
    v = asyncio.run(compare_digests(src, dst, chunk=MIB))
    assert v.result == "ok" and v.threads == 4 and v.as_dict()["threads"] == 4
    assert {a.get("threads") for a in src.called("x-query-ram-digest")} == {4}
    src, dst = _ends()
    dst.digest_threads = False
    dst.ram["pc.ram"][5 * MIB + 7] ^= 1  # and it still finds the changed page
    v = asyncio.run(compare_digests(src, dst, chunk=MIB))
    assert v.result == "mismatch" and v.mismatched_pages == 1 and v.threads == 1
    asked = [a.get("threads") for a in dst.called("x-query-ram-digest")]
    assert asked[0] == 2 and set(asked[1:]) == {None}  # refused once, then not asked
    # any other error is the comparison's
    src, dst = _ends()
    dst.commands = set()
    with pytest.raises(VMError, match="command not found"):
        asyncio.run(compare_digests(src, dst, chunk=MIB))


def test_a_probe_of_zeroes_says_nothing_of_the_rest_and_the_guest_is_sampled(
        small_ranges: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched QEMU digests zero chunks at memory speed (qemu/patches/0018): a
    probe that found only zeroes was quick for that alone, and the rest of RAM may
    hold data. It counts as the slowest rate: ranges at random, not all of RAM on a
    guess. The same budget takes all of RAM once the probe timed chunks with data."""
    monkeypatch.setattr(verify, "ZERO_DIGESTS",
                        {("sha256", MIB): hashlib.sha256(bytes(MIB)).hexdigest()})
    monkeypatch.setattr(verify, "_now", _clock(per_call=0.01))
    src, dst = _ends()
    for end in (src, dst):
        end.ram["pc.ram"][:MIB] = bytes(MIB)  # the probe's megabyte: zeroes
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=0.5, seed=3))
    assert v.result == "ok" and _whole_calls(src) == 0 and v.coverage is not None
    src, dst = _ends()
    v = asyncio.run(compare_digests(src, dst, chunk=MIB, budget=0.5, seed=3))
    assert v.result == "ok" and _whole_calls(src) == 1 and v.coverage is None


def test_data_bytes_leave_out_the_zero_chunks_and_count_a_short_last_one() -> None:
    zero = verify.ZERO_DIGESTS[("mix64x4", 4 << 20)]
    d = verify.Digest("mix64x4", 4 << 20, (
        verify.DigestBlock("pc.ram", 10 << 20, 0, (zero, "a" * 16, "b" * 16)),))
    assert verify.data_bytes(d) == (4 << 20) + (2 << 20)
    unknown = verify.Digest("sha256", 4 << 20, d.blocks)  # no zero digest known: all
    assert verify.data_bytes(unknown) == 10 << 20
