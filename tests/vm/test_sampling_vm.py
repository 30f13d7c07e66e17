"""The page samplers on real QEMUs (TCG guests started here from plain command lines,
not by the lab): every sampler sees what the guest does, the lab's RAM-file reader and
the QEMU samplers decide the same encoding, and an attach run on the unpatched build
gets the livemig profile's encoding from /proc/PID/mem and stock's throttle."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import QEMU, ROOT, livemig_cmd
from livemig.engine.adapt import Hints, adapt, context
from livemig.engine.endpoint import Endpoint
from livemig.engine.events import EventStream
from livemig.engine.plan import Plan
from livemig.lab.pagesample import FileSampler
from livemig.policy import encoding
from livemig.sampling.base import SampleResult
from livemig.sampling.peek import PeekSampler
from livemig.sampling.qemu import QemuSampler
from livemig.sampling.readers import PmemsaveReader, ProcMemReader, hmp_over
from livemig.settings import merge
from qemuhelp import free_port, guest_progress, start_qemu, stop

pytestmark = pytest.mark.vm
UPSTREAM = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"
# small rewrites in a hot set (a database updating rows) and whole-page rewrites
SMALL = "mem:size=96M,rate=0,hot=80/10,touch=128"  # flat out: clearly busy
PAGES = "mem:size=96M,rate=24M,hot=80/10,touch=4096,fill=mixed"


def _samples(tmp: Path, workload: str) -> tuple[list[SampleResult], encoding.Context]:
    """The file, procmem, pmemsave and (patched) QEMU samplers on one guest whose RAM
    is a shared file, taken one after the other."""
    mem = Path("/dev/shm") / f"livemig-test-{tmp.name}.ram"
    proc = start_qemu(tmp, "g", workload, memory="512M", mem_file=mem)
    try:
        time.sleep(8)  # boot, fill the region, start writing

        async def go() -> tuple[list[SampleResult], encoding.Context]:
            end = Endpoint("g", tmp / "g.qmp", pid=proc.pid)
            await end.connect(10)

            hmp = hmp_over(end.cmd)

            reader = PmemsaveReader(end.cmd, proc.pid, tmp)
            procmem = ProcMemReader(hmp, proc.pid, reader)
            out = [await FileSampler(mem).sample(1024),
                   await PeekSampler("procmem", hmp, procmem,
                                     prepare=procmem.prepare).sample(1024),
                   await PeekSampler("pmemsave", hmp, reader).sample(1024),
                   await QemuSampler(end.cmd).sample(1024)]
            assert procmem.fallbacks == 0  # every cluster came from QEMU's mapping
            procmem.close()
            reader.close()
            plan = Plan(uri="", settings=tuple(merge("livemig", {}).items())).validate()
            ctx = await context(end, plan, Hints(link_rate=50e6, cpus=1.0))
            await end.close()
            return out, ctx

        return asyncio.run(go())
    finally:
        stop(proc)
        mem.unlink(missing_ok=True)


@pytest.mark.parametrize("workload,expect", [(SMALL, "lz4-delta"), (PAGES, None)])
def test_every_sampler_sees_the_guest_and_they_decide_the_same(tmp_path, workload, expect):
    results, ctx = _samples(tmp_path, workload)
    names = [r.sampler for r in results]
    assert names == ["file", "procmem", "pmemsave", "qemu"]
    choices = {r.sampler: encoding.choose_sample(r.sample, ctx).encoding for r in results}
    for r in results:
        s = r.sample
        assert s.kept >= 64, (r.sampler, s)
        assert s.rewritten > 0, (r.sampler, s)
        assert s.rewritten / s.kept < 0.9, (r.sampler, s)
        if workload == SMALL:
            assert s.changed_share is not None and s.changed_share < 0.15, (r.sampler, s)
        else:
            # whole pages of mixed data rewritten: not the small deltas of a database
            assert s.changed_share is not None and s.changed_share > encoding.SMALL_DELTA, \
                (r.sampler, s)
        assert s.first["zstd"].ratio > 1.3, (r.sampler, s.first)  # mixed-entropy memory
    assert len(set(choices.values())) == 1, choices
    if expect:
        assert choices["qemu"] == expect, choices


def test_attach_on_the_unpatched_build_samples_its_mapping_and_throttles_as_stock(tmp_path):
    src = start_qemu(tmp_path, "src", SMALL, qemu=UPSTREAM)
    dst = start_qemu(tmp_path, "dst", SMALL, incoming=True, paused=True, qemu=UPSTREAM)
    try:
        # writing flat out before the sample (a guest still booting rewrites nothing,
        # and its sample is rightly decided at the half-way look)
        assert guest_progress(tmp_path / "src.agent") > 0
        report = tmp_path / "r.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--src-qmp", str(tmp_path / "src.qmp"), "--dst-qmp",
            str(tmp_path / "dst.qmp"), "--uri", f"tcp:127.0.0.1:{free_port()}",
            "--bandwidth", "50M", "--profile", "livemig", "--max-time", "120",
            "--report", str(report)), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rep: dict[str, Any] = json.loads(report.read_text())
        enc = rep["encoding"]
        # read from QEMU's mapping of the guest's RAM, not one cluster through pmemsave
        assert enc["sampler"]["name"] == "procmem" and enc["encoding"] in ("xbzrle", "zstd")
        assert enc["sampler"]["fallback_reads"] == 0, enc["sampler"]
        assert "lz4" not in enc["context"]["codecs"]  # stock multifd has no lz4
        # the encodings were played under QEMU's auto-converge ladder, with the curve
        # from the sampler's half-way look
        assert enc["context"]["auto_converge"] is True
        assert 0 < enc["sampler"]["mid_interval_s"] < enc["sampler"]["interval_s"], enc
        # and QEMU's own estimate over 100 ms of a flat-out writer (calc-dirty-rate)
        assert enc["sampler"]["short_rate_mib_s"] > 0, enc["sampler"]
        assert "under QEMU's auto-converge" in enc["reason"], enc["reason"]
        adapted = [e for e in rep["events"] if e["event"] == "adapted"]
        assert adapted and adapted[0]["to"] == "auto-converge"
        assert rep["settings"]["capabilities"].get("auto-converge") is True
        # the sampler's private files are gone
        assert not list(Path("/run/livemig").glob("livemig-sample-*"))
    finally:
        stop(src)
        stop(dst)


def test_the_three_readers_of_a_stock_qemu_read_the_same_bytes(tmp_path):
    """xp (a QEMU on another host has only its monitor) and QEMU's own mapping through
    /proc/PID/mem read the same bytes as pmemsave."""
    proc = start_qemu(tmp_path, "g", SMALL, qemu=UPSTREAM)
    try:
        time.sleep(6)  # the kernel in RAM, the workload writing

        async def go() -> list[bytes]:
            end = Endpoint("g", tmp_path / "g.qmp", pid=proc.pid)
            await end.connect(10)
            await end.cmd("stop")  # nothing changes between the reads

            hmp = hmp_over(end.cmd)

            from livemig.sampling.layout import parse_mtree
            from livemig.sampling.readers import XpReader
            reader = PmemsaveReader(end.cmd, proc.pid, tmp_path)
            procmem = ProcMemReader(hmp, proc.pid, reader)
            await procmem.prepare(parse_mtree(await hmp("info mtree -f")))
            out = []
            # the BIOS (outside the RAM ranges: procmem hands it to pmemsave) and the
            # kernel's first 64 KiB at 16 MiB, in RAM: non-zero
            for gpa in (0xF0000, 0x1000000):
                out += [await reader(gpa, 65536), await XpReader(hmp)(gpa, 65536),
                        await procmem(gpa, 65536)]
            assert procmem.fallbacks == 1
            procmem.close()
            reader.close()
            await end.close()
            return out

        got = asyncio.run(go())
        assert got[0] == got[1] == got[2] and got[0].count(0) < len(got[0])
        assert got[3] == got[4] == got[5] and got[3].count(0) < len(got[3])
    finally:
        stop(proc)


def test_second_plan_on_a_plain_qemu(tmp_path):
    """adapt() on a real patched QEMU: the first plan is untouched, the second frozen."""
    proc = start_qemu(tmp_path, "g", SMALL, qemu=QEMU)
    try:
        time.sleep(6)

        async def go() -> Any:
            end = Endpoint("g", tmp_path / "g.qmp", pid=proc.pid)
            await end.connect(10)
            plan = Plan(uri="", settings=tuple(merge("livemig", {}).items())).validate()
            a = await adapt(end, plan, Hints(link_rate=50e6), EventStream())
            await end.close()
            return plan, a

        plan, a = asyncio.run(go())
        assert a.plan is not plan and "multifd" not in plan.wanted
        # no destination that can switch codecs: the sample comes before `migrate`, and
        # a QEMU on this host is read through its mapping (the quicker to decide)
        assert a.encoding["sampler"]["name"] == "procmem"
        assert a.plan.wanted["multifd"] == "on" or a.plan.wanted.get("xbzrle") == "on"
        with pytest.raises(AttributeError):
            a.plan.uri = "x"  # type: ignore[misc]
    finally:
        stop(proc)
