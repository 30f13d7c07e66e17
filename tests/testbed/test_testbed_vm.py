"""Migrations between the testbed's hosts: shaped link, client probes, disk copy."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from conftest import TESTBED_WAIT, livemig_cmd, new_run_id, qemu_pids, run_migrate
from livemig.testbed import topology

pytestmark = pytest.mark.vm
MEM = "512M"
FAULTS = {"LIVEMIG_ALLOW_FAULT_INJECTION": "1"}


def test_busy_vm_over_1gbit_shared_storage_network_follows(tmp_path):
    r = run_migrate(tmp_path, "--memory", MEM, "--link", "1gbit",
                    "--workload", "mem:size=160M,rate=48M,hot=80/10", "--profile", "livemig",
                    "--max-time", "150")
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["consistency"]["ram"] == "ok"
    assert rep["settings"]["link_bits"] == 1_000_000_000
    net = rep["network"]
    assert rep["network_pause_ms"] is not None and 0 < rep["network_pause_ms"] < 5000
    assert net["probes_sent"] > 100 and rep["probes_lost"] < net["probes_sent"]
    # after the switchover the replies come through the destination host's tap
    assert net["after_switchover"]["answered_by"] == "destination", net
    assert net["after_switchover"]["packets_from_guest_on_src_tap"] == 0


def test_cross_storage_copy_with_disk_workload(tmp_path):
    r = run_migrate(tmp_path, "--memory", MEM, "--storage", "copy", "--disk-size", "128M",
                    "--workload", "mem:size=128M,rate=32M,hot=80/10+disk:bs=8K,rate=2M",
                    "--set", "disk-granularity=64K", "--set", "disk-copy-mode=background",
                    "--max-time", "150")
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["consistency"]["ram"] == "ok"
    assert rep["consistency"]["disk"] == "ok"
    assert rep["consistency"]["disk_detail"]["blocks_compared"] == (128 << 20) // 4096
    assert rep["disk_transferred_bytes"] >= 128 << 20
    assert rep["disk_dirty_amplification"] is not None
    assert rep["disk_dirty_amplification"] > 1.0  # 8K writes, 64K bitmap granularity
    assert any(e["event"] == "disk mirror ready" for e in rep["events"])


def test_disk_copy_turns_write_blocking_once_in_sync(tmp_path):
    # copy mode "ready" (the livemig profile's): background for the bulk copy, then
    # QEMU's block-job-change to write-blocking: nothing written after that is re-sent
    r = run_migrate(tmp_path, "--memory", MEM, "--storage", "copy", "--disk-size", "64M",
                    "--workload", "mem:size=64M,rate=16M,hot=80/10+disk:bs=8K,rate=2M",
                    "--set", "disk-granularity=8K", "--set", "disk-copy-mode=ready",
                    "--max-time", "150")
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["consistency"]["disk"] == "ok"
    started = [e for e in rep["events"] if e["event"] == "disk mirror started"]
    ready = [e for e in rep["events"] if e["event"] == "disk mirror ready"]
    assert started[0]["copy_mode"] == "ready"
    assert ready and ready[0]["copy_mode"] == "write-blocking"


def test_max_time_while_the_disk_copies_first_aborts_before_the_ram_starts(tmp_path):
    # 256 MiB of data over 100 Mbit/s takes ~22 s: --max-time 5 stops the engine's
    # monitor in its disk-first phase; migrate was never issued, the source runs on
    r = run_migrate(tmp_path, "--memory", MEM, "--storage", "copy", "--disk-size", "256M",
                    "--disk-fill", "mixed", "--link", "100mbit",
                    "--workload", "idle+disk:bs=4K,rate=1M", "--set", "warmup=1",
                    "--max-time", "5")
    rep = r.report
    assert r.rc == 3, rep.get("reason")
    assert rep["outcome"] == "aborted"
    assert rep["reason"] == "disk copy not done within --max-time 5s"
    assert "migration started" not in r.proc.stderr
    tl = rep["timeline"]  # the monitor's samples, every one before the RAM
    assert len(tl) >= 5 and {s["status"] for s in tl} == {"disk-first"}
    # the disk still to copy in every sample once the mirror has sized it (its
    # first answer may come before: len 0, no figure)
    sized = [s["remaining_disk"] for s in tl if s.get("remaining_disk") is not None]
    assert len(sized) >= 4 and all(r > 0 for r in sized) and tl[-1]["t"] > 5
    assert not any(e["event"] == "disk mirror ready" for e in rep["events"])
    assert rep["source_after"]["running"] is True
    assert rep["source_after"]["workload_rate"] > 0


def test_corrupted_destination_disk_block_is_named(tmp_path):
    offset = 0x345678
    r = run_migrate(tmp_path, "--memory", MEM, "--storage", "copy", "--disk-size", "64M",
                    "--workload", "idle+disk:bs=4K,rate=1M", "--set", "warmup=1",
                    "--inject-fault", f"disk-byte@{offset:#x}", "--max-time", "150",
                    env=FAULTS)
    rep = r.report
    assert r.rc == 4, rep.get("reason")
    # a destination whose disk differs never runs: the migration failed, the source
    # (its own image intact) runs on
    assert rep["outcome"] == "failed"
    assert rep["consistency"]["ram"] == "ok"
    assert rep["consistency"]["disk"] == "mismatch"
    detail = rep["consistency"]["disk_detail"]
    assert detail["mismatched_blocks"] == 1
    assert detail["first_mismatches"] == [f"{offset & ~0xFFF:#x}"]
    assert f"{offset & ~0xFFF:#x}" in rep["reason"]
    assert rep["source_after"]["running"] is True
    assert rep["source_after"]["workload_rate"] > 0


def test_killed_run_is_repaired_by_testbed_down(tmp_path):
    rid = new_run_id()
    proc = subprocess.Popen(
        livemig_cmd("migrate", "--accel", "tcg", "--memory", MEM, "--run-id", rid,
                    "--workload", "mem:size=256M,rate=0", "--bandwidth", "8M",
                    "--profile", "defaults", "--max-time", "300", "--set", "warmup=1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120 + TESTBED_WAIT  # queued for the testbed
        seen = ""
        while "migration started" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            seen += proc.stderr.readline()
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert topology.any_left()  # the killed run could not clean up
    down = subprocess.run(livemig_cmd("testbed", "down"), capture_output=True, text=True,
                          timeout=60)
    assert down.returncode == 0, down.stderr
    time.sleep(0.5)
    assert not topology.any_left()
    assert qemu_pids(rid) == []
    assert not list(topology.paths.shm_root().glob(f"livemig-{rid}-*"))
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "lm-" not in ns
    # and a new run works
    r = run_migrate(tmp_path, "--memory", MEM, "--workload", "idle", "--set", "warmup=1")
    assert r.rc == 0, r.report.get("reason")


def test_storage_copy_needs_a_disk_workload():
    p = subprocess.run(livemig_cmd("migrate", "--storage", "copy", "--workload", "idle"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "needs a workload with a disk" in p.stderr and "Traceback" not in p.stderr
