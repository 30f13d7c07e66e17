"""The stall watchdog on the real testbed: the migration link goes down in the
middle of a migration of a busy, throttled guest. The run must end within seconds
of the stall timeout, the guest running on the source only, with no throttle left."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from conftest import TESTBED_WAIT, livemig_cmd, new_run_id, qemu_pids
from livemig.testbed import topology

pytestmark = pytest.mark.vm
STALL_S = 5
# the watchdog's timeout, plus the poll that sees it, plus migrate_cancel, the
# settle period the lab observes the source for (2 s) and its cleanup
END_WITHIN_S = STALL_S + 20


def _link(state: str) -> None:
    """The src host's end of the migration link up or down (the run that created
    the testbed may have removed it already: then there is nothing to bring up)."""
    r = subprocess.run(["ip", "netns", "exec", topology.HOSTS["src"], "ip", "link", "set",
                        topology.MIG_IF, state], capture_output=True, text=True)
    assert r.returncode == 0 or (state == "up" and "No such file" in r.stderr), r.stderr


def test_link_down_mid_migration_is_cancelled_guest_runs_on_source(tmp_path):
    rid = new_run_id()
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        livemig_cmd("migrate", "--accel", "tcg", "--memory", "512M", "--run-id", rid,
                    "--workload", "mem:size=256M,rate=0", "--bandwidth", "48M",
                    "--profile", "defaults", "--set", "throttle=reference",
                    "--set", f"stall-timeout={STALL_S}", "--set", "warmup=1",
                    "--max-time", "300", "--report", str(report)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_down = None
    try:
        deadline = time.monotonic() + 180 + TESTBED_WAIT
        seen = ""
        # the reference throttle holds the guest (it acts at a round boundary once
        # the rounds stop shrinking), RAM is moving
        while not re.search(r"throttle [1-9]\d*%", seen.split("migration started")[-1]):
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            assert proc.stderr is not None
            seen += proc.stderr.readline()
        time.sleep(1.0)
        _link("down")
        t_down = time.monotonic()
        out, err = proc.communicate(timeout=END_WITHIN_S + 60)
        took = time.monotonic() - t_down
    finally:
        if t_down is not None:
            _link("up")
        if proc.poll() is None:
            proc.kill()
    print(out, err[-3000:])
    rep = json.loads(report.read_text())
    assert rep["outcome"] == "aborted", rep.get("reason")
    assert proc.returncode == 3
    assert "stalled" in rep["reason"] and f"stall-timeout {STALL_S}s" in rep["reason"]
    assert took < END_WITHIN_S, took
    # the throttle was on before the link went down, and nothing of it is left
    assert any(s.get("throttle_pct", 0) > 0 for s in rep["timeline"]), "never throttled"
    assert not rep["qemu_final_stats"].get("cpu-throttle-percentage")
    after = rep["source_after"]
    assert after["running"] is True and after["status"] == "running"
    # unthrottled again: the workload runs near its rate from before the migration
    assert after["workload_rate"] > 0.5 * rep["workload"]["baseline_rate"], after
    assert after["destination_alive"] is False
    assert qemu_pids(rid) == []
