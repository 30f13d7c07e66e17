"""The migration link dies during stop-and-copy, on the real testbed.

A slow link (16 Mbit/s) and a downtime limit of a minute make QEMU switch over
early and spend tens of seconds sending the final state with the guest paused and
its main lock held (QMP blocked). The link goes down in that window. Before the
switchover watch, the guest stayed paused until TCP gave up (minutes); now the
kernel's acked bytes stop, the migration is yanked out-of-band after the stall
timeout, QEMU fails it and resumes the source: the guest runs again on the source
within seconds, the destination never runs."""

from __future__ import annotations

import contextlib
import datetime
import json
import queue
import subprocess
import threading
import time

import pytest

from conftest import TESTBED_WAIT, livemig_cmd, new_run_id, qemu_pids
from livemig.testbed import topology

pytestmark = [pytest.mark.vm, pytest.mark.testbed, pytest.mark.long]
STALL_S = 5
QUIET_S = 3.0  # no progress line for this long after "migration started": QMP blocked
# the stall timeout, the looks at the kernel's count (0.5 s each), the yank, QEMU's
# failure path resuming the source, then livemig's rollback, the lab's settle (2 s)
# and cleanup
END_WITHIN_S = STALL_S + 25


def _link(state: str) -> None:
    r = subprocess.run(["ip", "netns", "exec", topology.HOSTS["src"], "ip", "link", "set",
                        topology.MIG_IF, state], capture_output=True, text=True)
    assert r.returncode == 0 or (state == "up" and "No such file" in r.stderr), r.stderr


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[tuple[float, str]]:
    q: queue.Queue[tuple[float, str]] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            q.put((time.monotonic(), line))

    threading.Thread(target=pump, daemon=True).start()
    return q


def test_link_down_during_stop_and_copy_source_resumes_within_the_stall_timeout(tmp_path):
    rid = new_run_id()
    report = tmp_path / "report.json"
    proc = subprocess.Popen(
        livemig_cmd("migrate", "--accel", "tcg", "--memory", "512M", "--run-id", rid,
                    "--workload", "mem:size=64M,rate=0", "--link", "16mbit",
                    "--profile", "defaults", "--set", "downtime-limit=60000",
                    "--set", f"stall-timeout={STALL_S}", "--set", "warmup=1",
                    "--max-time", "300", "--report", str(report)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _lines(proc)
    seen = ""
    t_down = None
    try:
        deadline = time.monotonic() + 240 + TESTBED_WAIT
        while "migration started" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            with contextlib.suppress(queue.Empty):
                seen += lines.get(timeout=1)[1]
        # stop-and-copy: the progress line (every second) stops while QMP is blocked
        last = time.monotonic()
        while time.monotonic() - last < QUIET_S:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            try:
                last, line = lines.get(timeout=0.2)
                seen += line
            except queue.Empty:
                pass
        _link("down")
        t_down, t_down_wall = time.monotonic(), time.time()
        proc.wait(timeout=END_WITHIN_S + 90)
        took = time.monotonic() - t_down
    finally:
        if t_down is not None:
            _link("up")
        if proc.poll() is None:
            proc.kill()
    while not lines.empty():
        seen += lines.get()[1]
    print(seen[-4000:])
    rep = json.loads(report.read_text())
    assert rep["outcome"] == "failed", rep.get("reason")
    assert "stalled during the switchover" in rep["reason"], rep["reason"]
    assert f"stall-timeout {STALL_S}s" in rep["reason"]
    yank = [e for e in rep["events"] if e["event"].startswith("phase yanking")]
    assert yank, [e["event"] for e in rep["events"]]
    # yanked within the stall timeout (plus the looks at the kernel's count and ss)
    t0 = datetime.datetime.fromisoformat(rep["started_at"]).timestamp()
    assert t0 + yank[0]["t"] - t_down_wall < STALL_S + 3, t0 + yank[0]["t"] - t_down_wall
    after = rep["source_after"]
    assert after["running"] is True and after["status"] == "running"
    assert after["destination_alive"] is False
    assert rep.get("destination_status") != "running"
    assert took < END_WITHIN_S, took
    assert qemu_pids(rid) == []
