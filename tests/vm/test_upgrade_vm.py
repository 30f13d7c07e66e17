"""``livemig upgrade`` on real TCG guests: CPR hands the running guest to a new QEMU.

Lab runs boot the guest on the testbed's src host with its tap, so the client's
probes show whether the new process answers; attach runs start a QEMU by hand."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import INITRD, KERNEL, QEMU, ROOT, livemig_cmd, qemu_pids
from livemig.engine.endpoint import Endpoint, socket_peer_pid
from livemig.upgrade import procfs

pytestmark = pytest.mark.vm

MEM = "512M"
BUSY = "mem:size=128M,rate=32M,hot=80/10+verify:mem=32M"


@pytest.fixture(scope="module")
def qemu_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second QEMU binary (a copy: the upgrade path does not depend on the build)."""
    b = tmp_path_factory.mktemp("qemu-b") / "qemu-system-x86_64"
    shutil.copy2(QEMU.resolve(), b)
    return b


def upgrade(tmp_path: Path, *args: str, timeout: float = 1200) -> tuple[int, dict, str]:
    report = tmp_path / "report.json"
    proc = subprocess.run(livemig_cmd("upgrade", "--quiet", "--report", str(report), *args),
                          capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr[-3000:])
    rep = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, rep, proc.stderr


def lab(tmp_path: Path, qemu_b: Path, workload: str, *args: str) -> tuple[int, dict, str]:
    return upgrade(tmp_path, "--from-qemu", str(QEMU), "--to-qemu", str(qemu_b), "--accel",
                   "tcg", "--memory", MEM, "--workload", workload, "--settle", "3", *args)


def assert_upgraded(rep: dict, mode: str) -> None:
    assert rep["outcome"] == "completed", rep.get("reason")
    assert rep["mode"] == mode
    up = rep["upgrade"]
    assert up["old_exited"] is True
    if mode == "cpr-exec":
        assert up["new_pid"] == up["old_pid"]
    else:
        assert up["new_pid"] != up["old_pid"]
    if mode != "cpr-exec":  # the process that measured it is gone after exec
        assert rep["downtime_ms"] is not None
    assert rep["guest_pause_ms"] is not None and rep["guest_pause_ms"] < 3000
    assert rep["pause_breakdown"]["qemu_pause_ms"] is not None
    assert rep["consistency"]["guest"] == "ok"
    # the client's probes are answered by the new QEMU's guest after the switch
    after = rep["network"]["after_switchover"]
    assert after["answered_by"] == "new qemu" and after["replies"] > 20
    assert rep["network"]["network_pause_ms"] is not None
    # the guest's agent keeps talking through the new QEMU
    assert up["counters"]["agent_after"] > 10  # heartbeats after the switch


def test_upgrade_idle_guest_cpr_transfer(tmp_path, qemu_b):
    rc, rep, _ = lab(tmp_path, qemu_b, "idle+verify:mem=32M")
    assert rc == 0
    assert_upgraded(rep, "cpr-transfer")
    assert rep["ram_transferred_bytes"] < 1 << 20  # handed over, not copied
    assert qemu_pids(rep["run_id"]) == []


def test_upgrade_busy_guest_keeps_counting_and_checker_clean(tmp_path, qemu_b):
    rc, rep, _ = lab(tmp_path, qemu_b, BUSY, "--mode", "cpr-transfer")
    assert rc == 0
    assert_upgraded(rep, "cpr-transfer")
    c = rep["upgrade"]["counters"]
    # cumulative counters continue from where they were (not restarted in a new guest)
    assert c["work_after"] > c["work_before"] > 0
    assert c["work_after"] - c["work_before"] > 32 << 20  # ~3 s of 32 MiB/s writing
    assert rep["workload"]["guest_agent_errors"] == 0


def test_upgrade_busy_guest_cpr_exec(tmp_path, qemu_b):
    rc, rep, _ = lab(tmp_path, qemu_b, BUSY, "--mode", "cpr-exec")
    assert rc == 0
    assert_upgraded(rep, "cpr-exec")
    c = rep["upgrade"]["counters"]
    assert c["work_after"] > c["work_before"] > 0


def test_lab_refusal_and_fallback_migrate(tmp_path, qemu_b):
    rc, rep, err = lab(tmp_path, qemu_b, "idle", "--no-aux-ram-share", "--link", "local")
    assert rc == 2
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("livemig:")]
    assert len(lines) == 1 and "aux-ram-share=on" in lines[0], err
    assert "Traceback" not in err
    rc, rep, _ = lab(tmp_path, qemu_b, BUSY, "--no-aux-ram-share", "--fallback", "migrate")
    assert rc == 0
    assert_upgraded(rep, "migrate")
    assert "aux-ram-share" in rep["upgrade"]["refused"]


# -- attach: a VM livemig did not start --------------------------------------------------
def start_vm(tmp_path: Path, shared: bool, qemu: Path = QEMU
             ) -> tuple[subprocess.Popen[bytes], Path]:
    qmp = tmp_path / "vm.qmp"
    argv = [str(qemu), "-L", "/usr/share/seabios", "-L", "/usr/share/qemu", "-nodefaults",
            "-display", "none", "-accel", "tcg", "-kernel", str(KERNEL), "-initrd",
            str(INITRD), "-append", "console=ttyS0 quiet livemig.workload=idle",
            "-serial", f"file:{tmp_path / 'console'}",
            "-qmp", f"unix:{qmp},server=on,wait=off"]
    if shared:
        ram = Path("/dev/shm") / f"livemig-test-{os.getpid()}-{time.monotonic_ns()}"
        argv += ["-machine", "q35,memory-backend=ram0,aux-ram-share=on", "-object",
                 f"memory-backend-file,id=ram0,size=256M,mem-path={ram},share=on", "-m", "256M"]
    else:
        argv += ["-machine", "q35", "-m", "256M"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 20
    while not qmp.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(2)  # let the guest boot a bit
    return proc, qmp


def status(qmp: Path) -> str:
    async def go() -> str:
        end = Endpoint("t", qmp)
        await end.connect(10)
        try:
            return str((await end.cmd("query-status"))["status"])
        finally:
            await end.close()
    return asyncio.run(go())


def stop_pid(pid: int | None) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def test_attach_anonymous_ram_refused_then_fallback_migrate(tmp_path, qemu_b):
    proc, qmp = start_vm(tmp_path, shared=False)
    new_pid = None
    try:
        rc, _, err = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(qemu_b))
        assert rc == 2
        assert "guest RAM is anonymous" in err and "Traceback" not in err
        assert proc.poll() is None and status(qmp) == "running"  # untouched
        rc, rep, _ = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(qemu_b),
                             "--fallback", "migrate")
        assert rc == 0, rep.get("reason")
        assert rep["mode"] == "migrate" and rep["outcome"] == "completed"
        new_pid = socket_peer_pid(qmp)
        assert new_pid == rep["upgrade"]["new_pid"] != proc.pid
        proc.wait(10)  # the old process quit once the new one ran the guest
        assert status(qmp) == "running"
        assert Path(os.readlink(f"/proc/{new_pid}/exe")) == qemu_b.resolve()
    finally:
        stop_pid(new_pid)
        proc.kill()


def test_attach_cpr_transfer_keeps_the_qmp_socket(tmp_path, qemu_b):
    proc, qmp = start_vm(tmp_path, shared=True)
    new_pid = None
    try:
        rc, rep, _ = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(qemu_b))
        assert rc == 0, rep.get("reason")
        assert rep["mode"] == "cpr-transfer"
        proc.wait(10)
        new_pid = socket_peer_pid(qmp)  # the old QEMU's exit did not unlink it
        assert new_pid == rep["upgrade"]["new_pid"]
        assert status(qmp) == "running"
        assert rep["pause_breakdown"]["qemu_pause_ms"] < 1000
    finally:
        stop_pid(new_pid)
        proc.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()


STOCK = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"


@pytest.mark.skipif(not STOCK.exists(), reason="no stock build (make qemu-upstream)")
def test_attach_stock_to_patched_and_back(tmp_path):
    """One running guest: stock QEMU -> build/qemu (the patched build) -> stock again."""
    proc, qmp = start_vm(tmp_path, shared=True, qemu=STOCK)
    pids: list[int | None] = []
    try:
        for target in (QEMU, STOCK):
            rc, rep, _ = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(target))
            assert rc == 0, rep.get("reason")
            pid = socket_peer_pid(qmp)
            pids.append(pid)
            assert pid == rep["upgrade"]["new_pid"]
            assert Path(os.readlink(f"/proc/{pid}/exe")) == target.resolve()
            assert status(qmp) == "running"
        proc.wait(10)
        assert len(set(pids)) == 2
        assert pids[0] is not None and not procfs.alive(pids[0])  # the middle one quit
    finally:
        for pid in pids:
            stop_pid(pid)
        proc.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()


def test_attach_upgrade_to_a_binary_that_is_not_a_qemu_is_refused_up_front(tmp_path):
    """--to-qemu that does not answer migration queries: one line, nothing touched."""
    broken = tmp_path / "qemu-broken"
    broken.write_text("#!/bin/sh\necho 'this QEMU cannot start' >&2\nexit 1\n")
    broken.chmod(0o755)
    proc, qmp = start_vm(tmp_path, shared=True)
    try:
        rc, _, err = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(broken))
        assert rc == 2 and "not a QEMU" in err and "Traceback" not in err
        assert proc.poll() is None and socket_peer_pid(qmp) == proc.pid
        assert status(qmp) == "running"
    finally:
        proc.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()


def test_attach_failed_upgrade_leaves_the_old_qemu_running(tmp_path):
    """A new binary that answers the up-front probe but dies when it starts for the
    guest: the old QEMU keeps the guest, running."""
    broken = tmp_path / "qemu-broken"
    broken.write_text(f"#!/bin/sh\ncase \" $* \" in *\"-machine none\"*) exec {QEMU} \"$@\";; "
                      "esac\necho 'this QEMU cannot start' >&2\nexit 1\n")
    broken.chmod(0o755)
    proc, qmp = start_vm(tmp_path, shared=True)
    try:
        rc, rep, err = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(broken))
        assert rc == 1, err
        assert rep["outcome"] == "failed" and "cannot start" in rep["reason"]
        assert "Traceback" not in err
        assert proc.poll() is None and socket_peer_pid(qmp) == proc.pid
        assert status(qmp) == "running"
    finally:
        proc.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()


def test_attach_paused_vm_is_refused(tmp_path, qemu_b):
    proc, qmp = start_vm(tmp_path, shared=True)
    try:
        async def pause() -> None:
            end = Endpoint("t", qmp)
            await end.connect(10)
            await end.cmd("stop")
            await end.close()
        asyncio.run(pause())
        rc, _, err = upgrade(tmp_path, "--qmp", str(qmp), "--to-qemu", str(qemu_b))
        assert rc == 2 and "not running" in err
        assert proc.poll() is None and status(qmp) == "paused"
    finally:
        proc.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()
