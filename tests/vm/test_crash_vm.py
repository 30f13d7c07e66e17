"""kill -9 of a lab ``livemig migrate`` mid-migration: no guest dies with it.

The guardian cancels the migration and the source guest keeps running with its
workload progressing; the destination, which never held the guest, is quit (its
incoming port closes); the next livemig command removes what the dead run left
(the source QEMU, RAM files, run directory). The matrix over signals and phases is
tests/vm/test_crash_matrix_vm.py (``long``)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import time

import pytest

from conftest import livemig_cmd, new_run_id, qemu_pids
from livemig import paths
from qemuhelp import guest_progress, qmp, read_until, throttle_left

pytestmark = pytest.mark.vm


def _patched() -> bool:
    """The build has livemig's management throttle (the livemig profile works)."""
    from conftest import QEMU

    if not QEMU.exists():
        return False
    with open(QEMU, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return m.find(b"set-cpu-throttle") >= 0


PATCHED = _patched()
PROFILE = "livemig" if PATCHED else "defaults"


def test_killed_lab_run_source_runs_on_then_cleaned_up():
    rid = new_run_id()
    run_dir = paths.run_root() / rid
    proc = subprocess.Popen(
        livemig_cmd("migrate", "--accel", "tcg", "--memory", "512M", "--run-id", rid,
                    "--link", "local", "--workload", "mem:size=192M,rate=0",
                    "--bandwidth", "8M", "--profile", PROFILE, "--max-time", "300",
                    "--set", "warmup=1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed while livemig's throttle holds the guest (patched QEMU), else mid-copy
        read_until(proc, r"throttle [1-9]\d*%" if PATCHED else "migration started", 150)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    try:
        assert qemu_pids(rid)  # nothing died with livemig (the guardian may be at work)
        log = run_dir / "guardian.log"
        deadline = time.monotonic() + 40
        while "repair done" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.5)
        assert "migrate_cancel" in log.read_text()
        # the destination never held the guest: quit, so its incoming port is closed
        assert "destination quit" in log.read_text()
        gone = time.monotonic() + 10  # QEMU exits a moment after its quit
        while len(qemu_pids(rid)) != 1:
            assert time.monotonic() < gone, qemu_pids(rid)
            time.sleep(0.2)
        sq = run_dir / "src.qmp"
        assert qmp(sq, "query-status")["status"] == "running"
        info = qmp(sq, "query-migrate")
        assert info["status"] == "cancelled"
        assert throttle_left(sq) == 0
        assert qmp(sq, "query-migrate-parameters")["max-bandwidth"] != 8 << 20  # restored
        # the guest's workload progresses on the source
        assert guest_progress(run_dir / "src.agent") > 0
    finally:
        # the next livemig command cleans up what the dead run left (not `testbed
        # down`: this run used no testbed, and other runs may be using it)
        nxt = subprocess.run(
            livemig_cmd("migrate", "--accel", "tcg", "--memory", "256M", "--link", "local",
                        "--workload", "idle", "--profile", "defaults", "--set", "warmup=0.5",
                        "-q"), capture_output=True, text=True, timeout=300)
    assert nxt.returncode == 0, nxt.stderr[-2000:]
    assert qemu_pids(rid) == []
    assert not list(paths.shm_root().glob(f"livemig-{rid}-*"))
    assert not run_dir.exists()
