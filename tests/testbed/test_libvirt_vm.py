"""libvirt as the multi-host engine: real libvirt daemons on the testbed's hosts, real
QEMU (TCG), domains defined from XML on the src daemon and migrated to the dst daemon
by ``livemig migrate --domain``.

Marked ``testbed`` and ``libvirt`` (not ``vm``): the domain's emulator is whichever
QEMU this checkout has built (the patched ``build/qemu`` first, else the unpatched
``build/qemu-upstream``; ``LIVEMIG_LIBVIRT_QEMU`` overrides), so they run before the
patched build exists too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import INITRD, KERNEL, ROOT, livemig_cmd
from livemig.testbed import libvirtd, netns, topology
from livemig.units import parse_link_rate
from livemig.virt.vcpus import domain_stats_reader

pytestmark = [pytest.mark.testbed, pytest.mark.libvirt]

MEMORY_MIB = 256
DISK_BYTES = 64 << 20
PATTERN = b"livemig-libvirt-test-"


def _emulator() -> Path | None:
    env = os.environ.get("LIVEMIG_LIBVIRT_QEMU")
    candidates = [Path(env)] if env else [ROOT / "build" / "qemu" / "qemu-system-x86_64",
                                          ROOT / "build" / "qemu-upstream" /
                                          "qemu-system-x86_64"]
    return next((p for p in candidates if p.exists()), None)


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    if _emulator() is None:
        return "no QEMU build (make qemu or make qemu-upstream, or LIVEMIG_LIBVIRT_QEMU)"
    for p in (KERNEL, INITRD):
        if not p.exists():
            return f"{p} missing: make guest"
    if shutil.which("libvirtd") is None:
        return "libvirtd missing: make deps"
    try:
        import libvirt  # noqa: F401
    except ImportError:
        return "libvirt-python missing: make venv"
    return None


if _missing() and not os.environ.get("CI"):  # in CI a missing piece is a failure
    pytestmark.append(pytest.mark.skip(reason=str(_missing())))


@pytest.fixture(scope="module")
def daemons() -> Iterator[dict[str, str]]:
    """The testbed with a libvirt daemon per host, held (lock) for the whole module."""
    with topology.locked():
        created = not topology.is_up()
        if created:
            topology.up(parse_link_rate(topology.DEFAULT_LINK), owner="tests (libvirt)")
        try:
            yield libvirtd.up()
        finally:
            libvirtd.down()
            if created:
                topology.down(quiet=True)


def _conn(side: str) -> Any:
    from livemig.virt.conn import libvirt_module

    return libvirt_module().open(libvirtd.local_uri(side))


def _define(name: str, storage: str, workload: str = "idle",
            emulator: Path | None = None) -> Path:
    """Define and start a domain on src; return its image as seen from here."""
    from livemig.virt.domain import lab_domain_xml

    if storage == "shared":
        image = libvirtd.shared_dir() / f"{name}.img"
        seen_by_daemon = str(image)
    else:
        image = libvirtd.image_path("src", f"{name}.img")
        seen_by_daemon = f"{libvirtd.IMAGES_DIR}/{name}.img"
    with open(image, "wb") as f:
        f.truncate(DISK_BYTES)
        for off in range(0, DISK_BYTES, 1 << 20):  # something to copy
            f.seek(off)
            f.write(PATTERN + off.to_bytes(8, "little"))
    emulator = emulator or _emulator()
    assert emulator is not None
    xml = lab_domain_xml(name, emulator, KERNEL, INITRD, seen_by_daemon,
                         memory_mib=MEMORY_MIB, workload=workload)
    c = _conn("src")
    try:
        c.defineXML(xml).create()
    finally:
        c.close()
    return image


def _guest_answers(timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = subprocess.run([*netns.exec_prefix(topology.HOSTS["client"]),
                              "ping", "-c", "1", "-W", "1", topology.GUEST_IP],
                             capture_output=True, text=True)
        if out.returncode == 0:
            return True
    return False


def _wait_busy(name: str, timeout: float = 180.0) -> None:
    """Until the guest's writer runs: booted (4 s), then its QEMU busy (> 30 % of a
    core: a loaded 2-core host gives it no more) for 3 s in a row; an idle guest of
    this image uses ~1 %."""
    time.sleep(4.0)
    c = _conn("src")
    try:
        d = c.lookupByName(name)
        end = time.monotonic() + timeout
        busy = 0
        while time.monotonic() < end:
            t0, c0 = time.monotonic(), d.info()[4]
            time.sleep(1.0)
            rate = (d.info()[4] - c0) / 1e9 / (time.monotonic() - t0)
            busy = busy + 1 if rate > 0.3 else 0
            if busy >= 3:
                return
    finally:
        c.close()
    raise AssertionError(f"{name}: the guest's writer did not start within {timeout:.0f} s")


def _cleanup(name: str) -> None:
    for side in ("src", "dst"):
        c = _conn(side)
        try:
            for d in c.listAllDomains():
                if d.name() == name:
                    if d.isActive():
                        d.destroy()
                    if d.isPersistent():
                        d.undefine()
        finally:
            c.close()


def _migrate(tmp_path: Path, name: str, *args: str, timeout: float = 240,
             env: dict[str, str] | None = None
             ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "report.json"
    proc = subprocess.run(livemig_cmd("migrate", "--domain", name,
                                      "--connect", libvirtd.uri("src"),
                                      "--to", libvirtd.uri("dst"), "--report", str(report),
                                      *args),
                          capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])
    assert report.exists(), f"no report; rc={proc.returncode}\n{proc.stderr[-2000:]}"
    return proc, json.loads(report.read_text())


def _where(name: str) -> dict[str, str | None]:
    """Each daemon's view of the domain: running, paused, ..., or None (unknown)."""
    from livemig.virt.conn import libvirt_module

    libvirt = libvirt_module()
    out: dict[str, str | None] = {}
    for side in ("src", "dst"):
        c = _conn(side)
        try:
            d = c.lookupByName(name)
            state = d.state()[0]
            out[side] = "running" if state == libvirt.VIR_DOMAIN_RUNNING else str(state)
        except libvirt.libvirtError:
            out[side] = None
        finally:
            c.close()
    return out


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_each_host_has_its_own_daemon(daemons: dict[str, str]) -> None:
    from livemig.virt.conn import open_uri

    for side in ("src", "dst"):
        out = subprocess.run(livemig_cmd("testbed", "libvirt-uri", side),
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == libvirtd.uri(side)
        assert out.stdout.startswith(f"qemu+tls://{topology.MIG_ADDR[side]}/system?pkipath=")
    src, dst = open_uri(daemons["src"], "src"), open_uri(daemons["dst"], "dst")
    try:
        assert src.getHostname() == "lm-src" and dst.getHostname() == "lm-dst"
        assert src.getCapabilities() != dst.getCapabilities()  # host UUIDs differ
    finally:
        src.close()
        dst.close()


def test_shared_storage_domain_moves_to_dst(daemons: dict[str, str], tmp_path: Path) -> None:
    name = _unique("lmshared")
    _define(name, "shared")
    try:
        assert _guest_answers(), "the guest did not come up on the src host's br0"
        proc, rep = _migrate(tmp_path, name, "--unsafe", "--max-time", "180")
        assert proc.returncode == 0, rep.get("reason")
        assert rep["outcome"] == "completed"
        assert rep["downtime_ms"] is not None and rep["ram_transferred_bytes"] > 0
        for key in ("total_time_s", "disk_transferred_bytes", "rounds", "cpu_seconds",
                    "consistency", "timeline", "settings", "events"):
            assert key in rep
        assert rep["destination"] == {"running": True, "persistent": True,
                                      "gone_from_source": True}
        rounds = [e["iteration"] for e in rep["events"] if e["event"] == "round"]
        assert rounds and rounds == sorted(rounds)  # libvirt's iteration events
        # the domain's QEMU runs on this kernel: its vCPUs' share of the CPU they ask
        # for is read from their scheduler statistics
        (share,) = [e for e in rep["events"] if e["event"].startswith("vcpu share")]
        assert share["event"] == "vcpu share read", share
        assert share["from"].startswith("this host's scheduler statistics"), share
        # a QEMU on another host is read through its daemon: vcpu.<n>.time and .delay
        c = _conn("dst")
        try:
            counters = domain_stats_reader(c, c.lookupByName(name))()
        finally:
            c.close()
        assert counters is not None and counters[0] > 0, counters
        assert _where(name) == {"src": None, "dst": "running"}
        assert _guest_answers(), "the guest does not answer from the dst host"
        ram = rep["consistency"]["ram_detail"]
        if _has_ram_check():  # the patched build verifies RAM inside the migration
            assert rep["consistency"]["ram"] == "ok", ram
            assert ram["method"] == "in-stream digest (x-ram-digest-check)"
            assert ram["bytes"] >= MEMORY_MIB << 20 and ram["blocks"] >= 1
            assert 0 < ram["source_s"] < 10 and 0 < ram["destination_s"] < 10
            assert rep["settings"]["libvirt_plan"]["ram_check"] == "in-stream digest"
        else:
            assert rep["consistency"]["ram"] == "skipped" and ram["why"]
    finally:
        _cleanup(name)


def _has_ram_check() -> bool:
    """Whether the domains' emulator has patch 0006 (x-ram-digest-check)."""
    emulator = _emulator()
    assert emulator is not None
    out = subprocess.run([str(emulator), "-M", "none", "-display", "none", "-S",
                          "-qmp", "stdio", "-nodefaults"], capture_output=True, text=True,
                         input='{"execute": "qmp_capabilities"}\n'
                               '{"execute": "query-migrate-capabilities"}\n'
                               '{"execute": "quit"}\n', timeout=30)
    return '"x-ram-digest-check"' in out.stdout


def test_corrupted_destination_ram_fails_the_migration(daemons: dict[str, str],
                                                        tmp_path: Path) -> None:
    """A byte of the destination's RAM flipped just before QEMU's in-stream check
    (patch 0006's testing-only fault): the migration fails naming the RAM block and
    chunk, the guest keeps running on src, livemig's passthrough setting is undone."""
    if not _has_ram_check():
        pytest.skip("the domain's emulator lacks x-ram-digest-check (patch 0006)")
    from livemig.virt import qmp

    offset = 0x1234567
    name = _unique("lmbadram")
    _define(name, "shared")
    try:
        report = tmp_path / "report.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--unsafe", "--report", str(report),
            "--inject-fault", f"ram-byte@{offset:#x}", "--max-time", "180"),
            capture_output=True, text=True, timeout=240,
            env={**os.environ, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
        rep = json.loads(report.read_text())
        assert proc.returncode == 4, proc.stderr[-2000:]  # a mismatch was found
        assert rep["outcome"] == "failed"
        assert rep["consistency"]["ram"] == "mismatch", rep["consistency"]
        chunk = offset & ~((1 << 20) - 1)
        detail = rep["consistency"]["ram_detail"]["detail"]
        assert f"bytes [{chunk:#x}, {chunk + (1 << 20):#x})" in detail, detail
        assert "guest RAM differs from the source" in rep["reason"]
        assert "RAM mismatch" in proc.stdout or "mismatch" in proc.stdout
        assert rep["source_after"]["status"] == "running"
        assert _where(name) == {"src": "running", "dst": None}
        c = _conn("src")
        try:
            caps = qmp.current_capabilities(c.lookupByName(name))
        finally:
            c.close()
        assert caps["x-ram-digest-check"] is False  # livemig's passthrough undone
    finally:
        _cleanup(name)


def test_copied_storage_domain_moves_with_its_disk(daemons: dict[str, str],
                                                   tmp_path: Path) -> None:
    name = _unique("lmcopy")
    src_image = _define(name, "copy")
    try:
        # the upstream profile: multifd with zstd, which libvirt 9.0 cannot name
        proc, rep = _migrate(tmp_path, name, "--storage", "copy", "--profile", "upstream",
                             "--max-time", "180")
        assert proc.returncode == 0, rep.get("reason")
        assert rep["outcome"] == "completed"
        assert rep["consistency"]["disk"] == "ok", rep["consistency"]
        assert _where(name) == {"src": None, "dst": "running"}
        dst_image = libvirtd.image_path("dst", f"{name}.img")
        assert dst_image != src_image and dst_image.exists()
        with open(dst_image, "rb") as f:
            f.seek(5 << 20)
            assert f.read(len(PATTERN)) == PATTERN
        plan = rep["settings"]["libvirt_plan"]
        assert "parallel" in plan["flags"] and "non_shared_disk" in plan["flags"]
        assert plan["destination_globals"] == {"multifd-compression": "zstd"}
    finally:
        _cleanup(name)


@pytest.mark.long
def test_postcopy_hands_the_guest_over_and_nothing_cancels_it(daemons: dict[str, str],
                                                              tmp_path: Path) -> None:
    """Post-copy under libvirt, watched by the engine's monitor: ``postcopy-after``
    asks libvirt to switch (``migrateStartPostCopy``), the job then reads as
    post-copy (the source paused for it), and ``--max-time`` passing in post-copy
    cancels nothing (the destination runs the guest): it completes on dst."""
    name = _unique("lmpost")
    _define(name, "shared", workload="mem:size=96M,rate=0")
    try:
        _wait_busy(name)
        proc, rep = _migrate(tmp_path, name, "--unsafe", "--bandwidth", "16M",
                             "--set", "postcopy-after=2", "--max-time", "6")
        assert proc.returncode == 0, rep.get("reason")
        assert rep["outcome"] == "completed"
        assert any(s["status"] == "postcopy-active" for s in rep["timeline"])
        assert any(e["event"] == "stop not possible in post-copy" for e in rep["events"])
        assert _where(name) == {"src": None, "dst": "running"}
    finally:
        _cleanup(name)


def _dst_link(state: str) -> None:
    """dst's end of the migration link (the veth's other end loses its carrier too);
    livemig's connections to the src daemon do not cross it."""
    r = subprocess.run(["ip", "netns", "exec", topology.HOSTS["dst"], "ip", "link", "set",
                        topology.MIG_IF, state], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.long
def test_link_down_mid_migration_is_aborted_by_the_stall_watchdog(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """The stall watchdog under libvirt (the engine's monitor): the migration link
    dies while RAM moves; livemig aborts libvirt's job for the stall, and the guest
    runs on the source."""
    stall_s = 5
    name = _unique("lmstall")
    _define(name, "shared", workload="mem:size=96M,rate=0")
    report = tmp_path / "report.json"
    proc: subprocess.Popen[str] | None = None
    t_down: float | None = None
    try:
        _wait_busy(name)
        proc = subprocess.Popen(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--unsafe", "--bandwidth", "8M",
            "--set", f"stall-timeout={stall_s}", "--max-time", "300",
            "--report", str(report)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        c = _conn("src")
        try:
            dom = c.lookupByName(name)
            deadline = time.monotonic() + 120
            while int(dom.jobStats().get("memory_processed") or 0) < 16 << 20:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.5)
        finally:
            c.close()
        _dst_link("down")
        t_down = time.monotonic()
        try:
            out, err = proc.communicate(timeout=240)
        finally:
            _dst_link("up")
        took = time.monotonic() - t_down
        sys.stdout.write(out)
        sys.stderr.write(err[-4000:])
        rep = json.loads(report.read_text())
        assert rep["outcome"] == "aborted", rep.get("reason")
        assert proc.returncode == 3
        assert str(rep["reason"]).startswith("stalled:"), rep["reason"]
        # the stall seen, the job aborted; libvirt's rollback may then wait on the dead
        # peer-to-peer connection to dst for its keepalive
        assert took < stall_s + 90, took
        assert rep["source_after"]["status"] == "running"
        assert _where(name)["src"] == "running"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        _cleanup(name)


def test_max_time_aborts_and_source_keeps_running(daemons: dict[str, str],
                                                  tmp_path: Path) -> None:
    name = _unique("lmabort")
    _define(name, "shared", workload="mem:size=96M,rate=0")
    try:
        proc, rep = _migrate(tmp_path, name, "--unsafe", "--bandwidth", "2M",
                             "--max-time", "4", "--set", "throttle-trigger-threshold=60")
        assert proc.returncode == 3, rep.get("reason")
        assert rep["outcome"] == "aborted"
        assert rep["source_after"]["status"] == "running"
        assert _where(name) == {"src": "running", "dst": None}
        from livemig.virt import qmp

        c = _conn("src")
        try:
            params = qmp.command(c.lookupByName(name), "query-migrate-parameters")
        finally:
            c.close()
        assert params["throttle-trigger-threshold"] == 50  # livemig's change undone

        # Ctrl-C does the same
        report = tmp_path / "sigint.json"
        proc2 = subprocess.Popen(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--report", str(report), "--unsafe",
            "--bandwidth", "2M", "-q"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        time.sleep(6)
        proc2.send_signal(signal.SIGINT)
        _out, err = proc2.communicate(timeout=120)
        assert proc2.returncode == 3, err
        rep2 = json.loads(report.read_text())
        assert rep2["outcome"] == "aborted" and "SIGINT" in rep2["reason"]
        assert _where(name) == {"src": "running", "dst": None}
    finally:
        _cleanup(name)


def test_unknown_domain_is_a_one_line_error(daemons: dict[str, str]) -> None:
    proc = subprocess.run(livemig_cmd("migrate", "--domain", "nosuch",
                                      "--connect", libvirtd.uri("src"),
                                      "--to", libvirtd.uri("dst")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nosuch" in lines[0], proc.stderr


def test_patched_knobs_through_passthrough(daemons: dict[str, str], tmp_path: Path) -> None:
    """The livemig profile on a guest that out-dirties the capped link: its converge
    throttle (set-cpu-throttle, renewed every poll) goes through the monitor
    passthrough; then back with lz4 multifd (passthrough on the source, -global in
    the destination XML). libvirt 9.0 has no name for either. Needs the patched
    build as the domain's emulator."""
    from livemig.virt import qmp

    name = _unique("lmknobs")
    _define(name, "shared", workload="mem:size=128M,rate=0")
    try:
        c = _conn("src")
        try:
            info = qmp.probe(c.lookupByName(name))
        finally:
            c.close()
        if info.throttle_knob is None:
            pytest.skip("the domain's emulator is not the patched build")
        _wait_busy(name)
        proc, rep = _migrate(tmp_path, name, "--unsafe", "--profile", "livemig",
                             "--bandwidth", "8M", "--max-time", "150")
        assert proc.returncode == 0, rep.get("reason")
        plan = rep["settings"]["libvirt_plan"]
        assert plan["throttle"] == "converge" and plan["throttle_knob"] is not None
        throttles = [e for e in rep["events"] if e["event"] == "action SetThrottle"]
        assert throttles, "the guest out-dirties 8M/s: the throttle must have acted"
        # the policy's own throttle actions went through the passthrough (a lease
        # renewal or the release may meet the domain already gone from the source
        # when the migration ends between two polls: that is not a refused knob)
        assert not any(e["event"] == "action not applied" and e["action"] == "SetThrottle"
                       for e in rep["events"]), [e for e in rep["events"]
                                                 if e["event"] == "action not applied"]
        assert _where(name) == {"src": None, "dst": "running"}
        enc = rep["encoding"]  # sampled by the patched QEMU itself, through libvirt
        assert enc["encoding"] and enc["sampler"]["name"] == "qemu", enc
        # ... beside the first pass (patches 0012, 0013): the stream started with zstd
        # keeping the delta cache, and switched to the choice or kept it; the
        # destination QEMU libvirt started got the capability by -global
        assert enc["started_with"] == "zstd" and "switched" in enc, enc
        assert "kept_because" not in enc, enc  # the guest is busy: the sample came in
        assert plan["destination_globals"]["x-multifd-compression-switch"] == "on"
        assert plan["source_passthrough"]["capabilities"][
            "x-multifd-compression-switch"] is True, plan

        back = tmp_path / "back"
        back.mkdir()
        report = back / "report.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("dst"),
            "--to", libvirtd.uri("src"), "--unsafe", "--report", str(report),
            "--set", "encoding=lz4", "--max-time", "150"),
            capture_output=True, text=True, timeout=240)
        rep = json.loads(report.read_text())
        assert proc.returncode == 0, rep.get("reason")
        plan = rep["settings"]["libvirt_plan"]
        assert "parallel" in plan["flags"]
        assert plan["destination_globals"] == {"multifd-compression": "lz4"}
        assert _where(name) == {"src": "running", "dst": None}
    finally:
        _cleanup(name)


def test_corrupted_destination_disk_is_named_and_held_paused(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """The testbed's file comparison (disk-check=file: every differing 4 KiB block);
    the NBD comparison's own negative test is in test_libvirt_diskcheck.py."""
    offset = 0x234567
    name = _unique("lmbad")
    _define(name, "copy")
    try:
        report = tmp_path / "report.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--storage", "copy", "--report", str(report),
            "--set", "disk-check=file", "--inject-fault", f"disk-byte@{offset:#x}",
            "--max-time", "180"),
            capture_output=True, text=True, timeout=240,
            env={**os.environ, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
        rep = json.loads(report.read_text())
        assert proc.returncode == 4, proc.stderr[-2000:]
        assert rep["outcome"] == "completed"
        assert rep["consistency"]["disk"] == "mismatch"
        vda = rep["consistency"]["disk_detail"]["disks"]["vda"]
        assert vda["first_mismatches"] == [f"{offset // 4096 * 4096:#x}"]
        assert vda["mismatched_blocks"] == 1
        # a guest whose disk differs is not run: held paused on dst, gone from src
        assert _where(name)["src"] is None and _where(name)["dst"] not in (None, "running")
    finally:
        _cleanup(name)


STREAM_METHOD = "libvirt volume stream"


def test_copied_disk_verified_through_libvirt_volume_streams(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """The comparison between real hosts, forced on the testbed: both daemons stream
    their image through libvirt's storage API, digested per 1 MiB on both sides."""
    name = _unique("lmstream")
    _define(name, "copy")
    try:
        proc, rep = _migrate(tmp_path, name, "--storage", "copy", "--set",
                             "disk-check=stream", "--max-time", "180")
        assert proc.returncode == 0, rep.get("reason")
        assert rep["outcome"] == "completed"
        disk = rep["consistency"]["disk_detail"]
        assert rep["consistency"]["disk"] == "ok", disk
        assert disk["method"].startswith(STREAM_METHOD), disk
        vda = disk["disks"]["vda"]
        assert vda["result"] == "ok" and vda["bytes"] == DISK_BYTES
        assert vda["chunk_size"] == 1 << 20
        assert vda["source_s"] > 0 and vda["destination_s"] > 0
        assert vda["cost_s_per_gib"]["source"] > 0
        assert rep["settings"]["libvirt_plan"]["disk_check"] == "stream"
        assert disk["hold_s"] >= vda["wall_s"]  # the guest waited for it, after downtime
        assert any(e["event"] == "destination resumed" for e in rep["events"])
        assert _where(name) == {"src": None, "dst": "running"}
        assert "disk ok (vda:" in proc.stdout
    finally:
        _cleanup(name)


def test_corrupted_destination_disk_is_named_by_the_volume_streams(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """A byte of the destination's image flipped (through libvirt: a volume upload)
    before the streamed comparison: a mismatch naming its chunk and byte, the
    destination held paused, the source's image untouched, exit 4."""
    offset = 0x234567
    name = _unique("lmbadstream")
    src_image = _define(name, "copy")
    before = src_image.read_bytes()
    try:
        report = tmp_path / "report.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--storage", "copy", "--report", str(report),
            "--set", "disk-check=stream", "--inject-fault", f"disk-byte@{offset:#x}",
            "--max-time", "180"),
            capture_output=True, text=True, timeout=240,
            env={**os.environ, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
        sys.stdout.write(proc.stdout)
        rep = json.loads(report.read_text())
        assert proc.returncode == 4, proc.stderr[-2000:]
        assert rep["outcome"] == "completed"
        assert rep["consistency"]["disk"] == "mismatch", rep["consistency"]
        vda = rep["consistency"]["disk_detail"]["disks"]["vda"]
        chunk = offset & ~((1 << 20) - 1)
        assert vda["method"].startswith(STREAM_METHOD)
        assert vda["mismatched_chunks"] == 1
        assert vda["first_differing_chunk"]["range"] == [f"{chunk:#x}",
                                                         f"{chunk + (1 << 20):#x}"]
        assert vda["first_differing_byte"] == f"{offset:#x}"
        assert f"at byte {offset:#x}" in proc.stdout
        assert not any(e["event"] == "destination resumed" for e in rep["events"])
        assert _where(name)["src"] is None and _where(name)["dst"] not in (None, "running")
        # only that byte of the destination's image differs; the source's is intact
        after = src_image.read_bytes()
        assert after[offset] == before[offset]
        dst = libvirtd.image_path("dst", f"{name}.img").read_bytes()
        assert dst[offset] == after[offset] ^ 0xFF
        assert dst[:offset] == after[:offset] and dst[offset + 1:] == after[offset + 1:]
    finally:
        _cleanup(name)


def test_copied_disk_outside_any_pool_is_skipped_with_what_to_define(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """The source's image is in a directory no storage pool of the src daemon covers
    (the dst daemon has one there, for libvirt's pre-creation): the streamed
    comparison says which pool to define, and the destination runs."""
    from livemig.virt.domain import lab_domain_xml

    name = _unique("lmnopool")
    directory = "/var/lib/libvirt/nopool"
    for side in ("src", "dst"):
        libvirtd.host_view(side, directory).mkdir(exist_ok=True)
    image = libvirtd.host_view("src", f"{directory}/{name}.img")
    with open(image, "wb") as f:
        f.truncate(DISK_BYTES)
    emulator = _emulator()
    assert emulator is not None
    c = _conn("dst")
    pool = c.storagePoolCreateXML(f"<pool type='dir'><name>{name}</name><target><path>"
                                  f"{directory}</path></target></pool>", 0)
    try:
        s = _conn("src")
        try:
            s.defineXML(lab_domain_xml(name, emulator, KERNEL, INITRD,
                                       f"{directory}/{name}.img",
                                       memory_mib=MEMORY_MIB)).create()
        finally:
            s.close()
        proc, rep = _migrate(tmp_path, name, "--storage", "copy", "--set",
                             "disk-check=stream", "--max-time", "180")
        assert proc.returncode == 0, rep.get("reason")
        disk = rep["consistency"]["disk_detail"]
        assert rep["consistency"]["disk"] == "skipped", disk
        why = disk["disks"]["vda"]["why"]
        assert f"is in no storage pool on lm-src: define a dir pool over {directory}" in why
        assert "define a dir pool" in proc.stdout
        assert _where(name) == {"src": None, "dst": "running"}
    finally:
        _cleanup(name)
        with contextlib.suppress(Exception):
            pool.destroy()
        c.close()
        for side in ("src", "dst"):
            shutil.rmtree(libvirtd.host_view(side, directory), ignore_errors=True)


def test_killed_livemig_leaves_the_guest_running_and_unthrottled(
        daemons: dict[str, str], tmp_path: Path) -> None:
    """kill -9 of livemig mid-migration: libvirt goes on with its peer-to-peer job,
    the guest keeps running on src, no livemig throttle (patched build) is left (it
    lapses with its 1 s lease), the run's guard puts its passthrough setting back once
    the job ended, and should a guard not have, the next run for the domain does."""
    from livemig.virt import hold, journal, qmp

    name = _unique("lmkill")
    _define(name, "shared", workload="mem:size=128M,rate=0")
    try:
        c = _conn("src")
        try:
            knob = qmp.probe(c.lookupByName(name)).throttle_knob
        finally:
            c.close()
        _wait_busy(name)
        proc = subprocess.Popen(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--unsafe", "--bandwidth", "4M",
            "--set", "throttle-trigger-threshold=60"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            seen = ""
            while True:  # once QEMU's migration runs
                assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
                line = proc.stderr.readline() if proc.stderr else ""
                seen += line
                if " active " in line:
                    break
            time.sleep(1.0)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
        time.sleep(2.5)  # > the 1 s lease
        c = _conn("src")
        try:
            d = c.lookupByName(name)
            from livemig.virt.conn import libvirt_module

            assert d.state()[0] == libvirt_module().VIR_DOMAIN_RUNNING
            assert _guest_answers(10), "the guest does not answer on the network"
            if knob == "command":
                assert qmp.command(d, "query-cpu-throttle")["management-percent"] == 0
            elif knob == "parameter":
                params = qmp.command(d, "query-migrate-parameters")
                assert params.get("cpu-throttle-direct", 0) == 0
            with contextlib.suppress(Exception):
                d.abortJob()  # libvirt's job outlives livemig; end it
            end = time.monotonic() + 60
            while d.jobInfo()[0] != 0 and time.monotonic() < end:
                time.sleep(0.2)
            # the dead run's guard puts its passthrough setting back once no job runs
            end = time.monotonic() + 20
            while qmp.command(d, "query-migrate-parameters")[
                    "throttle-trigger-threshold"] != 50:
                assert time.monotonic() < end, (hold.guard_dir(name) / "hold.log").read_text()
                time.sleep(0.5)
            assert not journal.path(name).exists()
            assert "settings put back" in (hold.guard_dir(name) / "hold.log").read_text()
            # a run whose guard could not (a daemon away for its whole wait) leaves
            # its journal: written here as a dead process's, with the setting still on
            qmp.command(d, "migrate-set-parameters", **{"throttle-trigger-threshold": 60})
        finally:
            c.close()
        gone = subprocess.Popen(["true"])
        gone.wait()
        p = journal.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"domain": name, "owner_pid": gone.pid, "owner_start": "0",
                                 "src_uri": libvirtd.uri("src"),
                                 "dst_uri": libvirtd.uri("dst"),
                                 "params": {"throttle-trigger-threshold": 50}}))
        # ... the next livemig run for this domain undoes it
        proc2, rep = _migrate(tmp_path, name, "--unsafe", "--bandwidth", "2M",
                              "--max-time", "3", "--set", "throttle-trigger-threshold=70")
        assert proc2.returncode == 3, rep.get("reason")
        assert any(e["event"] == "repaired a dead run's settings" for e in rep["events"])
        # and its own change (70) is undone to the real original, not to the leftover
        # (with the switchover drain on, the parameters libvirt manages are put back
        # too: libvirt's own reset fails while the drain is on)
        restored = rep["source_after"]["restored"]["parameters"]
        assert restored["throttle-trigger-threshold"] == 50, restored
        c = _conn("src")
        try:
            params = qmp.command(c.lookupByName(name), "query-migrate-parameters")
            assert params["throttle-trigger-threshold"] == 50
        finally:
            c.close()
    finally:
        _cleanup(name)


@pytest.mark.parametrize("sampler,expect", [("auto", "procmem"), ("peek", "libvirt-peek")])
def test_livemig_profile_on_a_stock_emulator_samples_the_domains_pages(
        daemons: dict[str, str], tmp_path: Path, sampler: str, expect: str) -> None:
    """A domain on the unpatched build gets the livemig profile's encoding from a
    sample, and QEMU's auto-converge instead of the patched throttle, as the stock
    profiles. Its QEMU runs on this kernel, so ``auto`` reads the pages from QEMU's
    own mapping (found through the vCPU threads and the domain's UUID); ``peek`` reads
    them with libvirt's memoryPeek, as for a daemon on another host (no file on the
    domain's host is read)."""
    upstream = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"
    if not upstream.exists():
        pytest.fail("the unpatched build is missing: make qemu-upstream")
    name = _unique("lmpeek")
    _define(name, "shared", workload="mem:size=96M,rate=24M,hot=80/10,touch=128",
            emulator=upstream)
    try:
        _wait_busy(name)
        proc, rep = _migrate(tmp_path, name, "--unsafe", "--profile", "livemig",
                             "--bandwidth", "32M", "--max-time", "150",
                             "--set", f"sampler={sampler}")
        assert proc.returncode == 0, rep.get("reason")
        enc = rep["encoding"]
        assert enc["sampler"]["name"] == expect, enc
        assert enc["sampler"].get("fallback_reads", 0) == 0, enc["sampler"]
        assert enc["sampler"]["rewritten"] > 0 and enc["encoding"] in ("xbzrle", "zstd")
        # weighed under the domain's auto-converge, from the three looks and QEMU's own
        # 100 ms estimate (calc-dirty-rate through libvirt's monitor passthrough)
        assert enc["context"]["auto_converge"] is True
        assert enc["sampler"]["mid_rewritten"] is not None
        # measured, not necessarily above 0: QEMU hashes 512 random pages per GiB for
        # 100 ms, and a hot set of a few percent of the RAM can miss all of them (a
        # CI run read 0 MiB/s); a refused or missing window has no key
        assert enc["sampler"]["short_rate_mib_s"] >= 0, enc["sampler"]
        adapted = {e["setting"]: e["to"] for e in rep["events"] if e["event"] == "adapted"}
        assert adapted.get("throttle") == "auto-converge"
        assert "auto_converge" in rep["settings"]["libvirt_plan"]["flags"]
        assert _where(name) == {"src": None, "dst": "running"}
    finally:
        _cleanup(name)


def test_livemig_profile_drains_and_caps_the_copied_disk(daemons: dict[str, str],
                                                         tmp_path: Path) -> None:
    """--profile livemig on a domain whose guest writes its disk while libvirt copies
    it at 1 MiB/s: seen from outside while livemig runs, the source QEMU has the
    switchover drain on (beside libvirt's return-path) and the copied disk's writes
    capped (IO QoS); --max-time then aborts, and the source runs on with nothing left
    set: no drain, none of the capabilities libvirt set (its own reset fails while the
    drain is on: livemig redoes it), the bandwidth as before, no IO cap. Needs the
    patched build (x-switchover-drain, patch 0007)."""
    from livemig.virt import qmp

    name = _unique("lmqos")
    _define(name, "copy", workload="disk:bs=4K,rate=4M")
    c = _conn("src")
    try:
        dom = c.lookupByName(name)
        if "x-switchover-drain" not in qmp.probe(dom).capabilities:
            pytest.skip("the domain's emulator is not the patched build")
        before = qmp.command(dom, "query-migrate-parameters")
        _wait_busy(name)
        report = tmp_path / "report.json"
        proc = subprocess.Popen(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--storage", "copy", "--profile", "livemig",
            "--bandwidth", "1M", "--max-time", "30", "--report", str(report)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        drain_seen = return_path_seen = False
        cap_seen = 0
        while proc.poll() is None:
            time.sleep(0.5)
            with contextlib.suppress(Exception):
                caps = qmp.current_capabilities(dom)
                drain_seen |= caps.get("x-switchover-drain", False)
                return_path_seen |= caps.get("return-path", False)
                for b in qmp.command(dom, "query-block"):
                    if "virtio-disk0" in str(b.get("qdev")):
                        cap_seen = max(cap_seen, int(b["inserted"].get("bps_wr") or 0))
        out, err = proc.communicate()
        sys.stdout.write(out)
        sys.stderr.write(err[-4000:])
        rep = json.loads(report.read_text())
        assert proc.returncode == 3, (proc.returncode, rep.get("reason"))
        assert rep["outcome"] == "aborted"
        plan = rep["settings"]["libvirt_plan"]
        assert plan["switchover_drain"] and plan["io_qos"]
        assert drain_seen and return_path_seen, "the source never had the drain on"
        events = [e["event"] for e in rep["events"]]
        print("io-qos:", [e for e in rep["events"] if "IoThrottle" in e["event"]
                          or e["event"].startswith("io")], "largest cap seen:", cap_seen)
        assert "action SetIoThrottle" in events, rep["events"]
        assert cap_seen > 0, "the copied disk's writes were never capped"
        assert "action not applied" not in events
        notes = [e["note"] for e in rep["events"] if e["event"] == "not applied"]
        assert any(n.startswith("pin not applied") for n in notes)
        assert any(n.startswith("disk-schedule not applied") for n in notes)
        # the source runs on as it was
        assert rep["source_after"]["status"] == "running"
        assert _where(name) == {"src": "running", "dst": None}
        caps = qmp.current_capabilities(dom)
        assert not any(caps.get(k) for k in ("x-switchover-drain", "return-path", "multifd",
                                             "pause-before-switchover")), caps
        after = qmp.command(dom, "query-migrate-parameters")
        assert {k: after[k] for k in ("max-bandwidth", "downtime-limit")} == \
            {k: before[k] for k in ("max-bandwidth", "downtime-limit")}
        disk = next(b for b in qmp.command(dom, "query-block")
                    if "virtio-disk0" in str(b.get("qdev")))
        assert int(disk["inserted"].get("bps_wr") or 0) == 0
    finally:
        c.close()
        _cleanup(name)


@contextlib.contextmanager
def _stock_on(side: str, patched: Path, stock: Path) -> Iterator[None]:
    """``side``'s host sees the unpatched build at the patched build's path (a host
    not yet upgraded): a bind mount in its daemon's own mount namespace."""
    pid = libvirtd.daemon_pid(side)
    assert pid is not None
    enter = ["nsenter", "-t", str(pid), "-m"]
    subprocess.run([*enter, "mount", "--bind", str(stock), str(patched)], check=True)
    try:
        yield
    finally:
        subprocess.run([*enter, "umount", "-l", str(patched)], check=True)  # its QEMU runs on


def test_patched_source_to_a_host_not_yet_upgraded(daemons: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The domain's emulator is the patched build on the source host and the stock
    build, at the same path, on the destination host. Its QEMU refuses the patched
    build's -global at its start; livemig tries again with what a stock QEMU has and
    says so. Before, the migration failed there (the source kept running). A second
    domain, told the destination is stock as ``livemig evacuate`` tells the VMs after
    the first (STOCK_PEER_ENV; the first wrote what was refused to STOCK_FOUND_ENV's
    file), starts as the retry did: no refused first attempt. A third, with its
    encoding given (no codec switch: nothing refused at the start), fails on the RAM
    check's section at the end of the stream and is tried once more too."""
    from livemig.virt.plan import STOCK_FOUND_ENV, STOCK_PEER_ENV

    patched = ROOT / "build" / "qemu" / "qemu-system-x86_64"
    stock = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"
    if not (patched.exists() and stock.exists()):
        pytest.fail("both builds are needed: make qemu qemu-upstream")
    name, told, late = _unique("lmmixed"), _unique("lmtold"), _unique("lmlate")
    (tmp_path / "told").mkdir()
    (tmp_path / "late").mkdir()
    for n in (name, told, late):
        _define(n, "shared", workload="mem:size=64M,rate=8M,hot=80/10,touch=128",
                emulator=patched)
    try:
        time.sleep(4.0)  # booted
        with _stock_on("dst", patched, stock):
            proc, rep = _migrate(tmp_path, name, "--unsafe", "--profile", "livemig",
                                 "--bandwidth", "32M", "--max-time", "150",
                                 env={STOCK_FOUND_ENV: str(tmp_path / "found")})
            proc2, rep2 = _migrate(tmp_path / "told", told, "--unsafe", "--profile",
                                   "livemig", "--bandwidth", "32M", "--max-time", "150",
                                   env={STOCK_PEER_ENV: "the test's word"})
            # an encoding given: no codec switch, so no -global for the destination to
            # refuse at its start; it fails on the RAM check's section at the end of
            # the stream instead (the source resumed), and is tried once more too
            proc3, rep3 = _migrate(tmp_path / "late", late, "--unsafe", "--profile",
                                   "livemig", "--bandwidth", "32M", "--max-time", "150",
                                   "--set", "encoding=zstd")
        assert proc3.returncode == 0, rep3.get("reason")
        again3 = next(e for e in rep3["events"] if e["event"] == "retried for a stock destination")
        assert again3["refused"] == "x-ram-digest-check", again3
        assert "Unknown section or instance 'ram-digest-check'" in again3["first_reason"]
        assert _where(late) == {"src": None, "dst": "running"}
        assert proc2.returncode == 0, rep2.get("reason")
        kinds = [e["event"] for e in rep2["events"]]
        assert "stock destination" in kinds and "retried for a stock destination" \
            not in kinds, kinds
        assert "the test's word" in proc2.stderr
        assert "lz4" not in rep2["encoding"]["context"]["codecs"], rep2["encoding"]
        assert _where(told) == {"src": None, "dst": "running"}
        assert proc.returncode == 0, rep.get("reason")
        again = next(e for e in rep["events"] if e["event"] == "retried for a stock destination")
        assert again["refused"] == "x-multifd-compression-switch", again
        # what livemig evacuate reads while the run goes on
        assert (tmp_path / "found").read_text() == again["refused"]
        assert "again with what a stock QEMU has" in proc.stderr
        # nothing of the patched build's stream: no switch, no delta, no in-stream check
        assert "lz4" not in rep["encoding"]["context"]["codecs"], rep["encoding"]
        assert rep["encoding"].get("deferred") is not True
        assert "the destination's QEMU has no" in rep["consistency"]["ram_detail"]["why"]
        assert _where(name) == {"src": None, "dst": "running"}
    finally:
        _cleanup(name)
        _cleanup(told)
        _cleanup(late)
