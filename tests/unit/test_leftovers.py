"""The reaper removes what runs of dead livemig processes left, never a live run's."""

from __future__ import annotations

import json
import subprocess

from livemig.lab.leftovers import RunState, reap


def test_reap_spares_live_runs_and_removes_dead_ones(tmp_path):
    live_dir, dead_dir = tmp_path / "live", tmp_path / "dead"
    live = RunState(live_dir)
    ram_live = tmp_path / "live.ram"
    ram_live.write_bytes(b"x")
    live.add_file(ram_live)

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = RunState(dead_dir)
        ram_dead = tmp_path / "dead.ram"
        ram_dead.write_bytes(b"x")
        dead.add_file(ram_dead)
        dead.add_qemu("src", sleeper.pid)
        data = json.loads(dead.path.read_text())
        data["owner_pid"] = 999_999_999  # an owner that does not exist
        dead.path.write_text(json.dumps(data))

        removed = reap(tmp_path)
        assert sleeper.wait(timeout=10) == -9  # the dead run's process was killed
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
    assert not ram_dead.exists() and not dead_dir.exists()
    assert any("dead.ram" in r for r in removed)
    assert ram_live.exists() and live.path.exists()  # this process owns it: untouched


def test_reused_pid_is_not_the_owner(tmp_path):
    st = RunState(tmp_path / "r")
    st.add_file(tmp_path / "gone.ram")
    data = json.loads(st.path.read_text())
    data["owner_start"] = "1"  # our pid, but a different process start time
    st.path.write_text(json.dumps(data))
    reap(tmp_path)
    assert not (tmp_path / "r").exists()
