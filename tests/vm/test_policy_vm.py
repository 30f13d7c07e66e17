"""Convergence policies on the testbed, with real guests."""

from __future__ import annotations

import pytest

from conftest import run_migrate

pytestmark = pytest.mark.vm
MEM = "512M"


def test_heavy_hot_set_over_1gbit_completes_with_livemig_profile(tmp_path):
    r = run_migrate(tmp_path, "--memory", MEM, "--link", "1gbit", "--profile", "livemig",
                    "--workload", "mem:size=256M,rate=0,hot=80/10,touch=64",
                    "--max-time", "150")
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["outcome"] == "completed"
    assert rep["consistency"]["ram"] == "ok"
    assert rep["network"]["after_switchover"]["answered_by"] == "destination"


@pytest.mark.long  # ~150 s; make test keeps test_unconvergeable_workload_aborts_... and
# the stall watchdog's cancel (test_stall_vm.py), and the policy's abort is unit-tested
def test_on_stall_abort_leaves_the_source_running(tmp_path):
    """Flat-out writer, 3 MB/s stream: even the deepest throttle the policy takes (96 %,
    its sleeps capped by the downtime limit) leaves the guest dirtying faster than the
    stream; the strategy is exhausted and on-stall=abort cancels."""
    r = run_migrate(tmp_path, "--memory", "320M", "--profile", "livemig", "--bandwidth", "3M",
                    "--workload", "mem:size=96M,rate=0", "--set", "xbzrle=off",
                    "--set", "downtime-ramp=off", "--set", "on-stall=abort",
                    "--set", "warmup=1", "--max-time", "400")
    rep = r.report
    assert r.rc == 3, rep.get("reason")
    assert rep["outcome"] == "aborted"
    assert "aborting, source keeps running" in rep["reason"]
    assert any(e["event"] == "action AbortMigration" for e in rep["events"])
    assert rep["source_after"]["running"] is True
    assert rep["source_after"]["workload_rate"] > 0
    # the throttle was lifted: the guest works at a sizeable share of its normal rate
    assert rep["source_after"]["workload_rate"] > 0.2 * rep["workload"]["baseline_rate"]


def test_io_qos_makes_a_disk_copy_converge_and_lifts_the_cap(tmp_path):
    """4K writes with a 1M bitmap: every write re-dirties a whole megabyte, the first
    pass never ends (the same run without io-qos aborts); capping the guest's writes
    step by step lets it finish. Background mode: the livemig profile's write-blocking
    mirror would keep up by itself."""
    r = run_migrate(tmp_path, "--memory", MEM, "--storage", "copy",
                    "--workload", "mem:size=128M,rate=16M,hot=80/10+disk:bs=4K,rate=4M",
                    "--set", "disk-granularity=1M", "--set", "io-qos=on",
                    "--set", "disk-copy-mode=background",
                    "--max-time", "150")
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["consistency"]["disk"] == "ok"
    caps = [e["write_bytes_per_s"] for e in rep["events"] if e["event"] == "action SetIoThrottle"]
    assert caps and caps == sorted(caps, reverse=True)  # step by step, lower each time
    assert any(e["event"] == "io cap removed" for e in rep["events"])
