"""Files a local user cannot take over: run directories 0700, state files and logs
0600, the lab's guest RAM files created exclusively (unit tests, no QEMU)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from livemig import private
from livemig.errors import SetupError

OTHER_UID = 54321  # a local user that is not livemig's


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_run_dir_is_private_and_an_existing_one_is_made_private(tmp_path):
    d = private.make_dir(tmp_path / "runs" / "r1")
    assert mode(d) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o777)
    private.make_dir(loose)
    assert mode(loose) == 0o700


def test_run_dir_that_is_a_symlink_or_someone_elses_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(SetupError, match="not a directory"):
        private.make_dir(tmp_path / "link")
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(SetupError, match=f"uid {OTHER_UID}"):
        private.make_dir(theirs)


def test_logs_and_state_files_are_0600_and_never_followed_through_a_symlink(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("old")
    os.chmod(log, 0o644)
    os.close(private.open_file(log))
    assert mode(log) == 0o600 and log.read_text() == ""
    private.write_text(tmp_path / "state.json", "{}")
    assert mode(tmp_path / "state.json") == 0o600
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "trap.log").symlink_to(victim)
    with pytest.raises(OSError):
        private.open_file(tmp_path / "trap.log")
    assert victim.read_text() == "keep"


def test_ram_file_is_created_exclusively_0600(tmp_path):
    ram = private.create_exclusive(tmp_path / "g.ram")
    assert ram.stat().st_size == 0 and mode(ram) == 0o600
    ram.write_bytes(b"stale")  # livemig's own leftover (same run id after a crash)
    private.create_exclusive(ram)
    assert ram.stat().st_size == 0 and mode(ram) == 0o600


def test_ram_file_planted_by_someone_else_or_a_symlink_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"")
    (tmp_path / "link.ram").symlink_to(target)
    with pytest.raises(SetupError, match="not livemig's"):
        private.create_exclusive(tmp_path / "link.ram")
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    planted = tmp_path / "planted.ram"
    planted.write_bytes(b"")
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(SetupError, match="refusing to use it as guest RAM"):
        private.create_exclusive(planted)
    assert planted.exists()  # not ours: not removed either


def test_lab_state_file_is_0600_in_a_0700_run_dir(tmp_path):
    from livemig.lab.leftovers import RunState

    st = RunState(tmp_path / "run")
    st.add_file(tmp_path / "f")
    assert mode(tmp_path / "run") == 0o700 and mode(st.path) == 0o600
    assert json.loads(st.path.read_text())["files"] == [str(tmp_path / "f")]


def test_guardian_files_are_private(tmp_path):
    from livemig.engine import guardian

    h = guardian.start({"src": "", "dst": ""}, tmp_path / "g")
    h.dismiss()
    assert mode(tmp_path / "g") == 0o700
    assert mode(tmp_path / "g" / "guardian.json") == 0o600
    assert mode(tmp_path / "g" / "guardian.log") == 0o600


def test_lab_creates_the_ram_file_before_qemu_and_refuses_a_planted_one(tmp_path,
                                                                         monkeypatch):
    from livemig.lab.run import LabRun, MigrateOptions
    from livemig.spec import parse_workload

    monkeypatch.setenv("LIVEMIG_SHM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "shm").mkdir()
    lab = LabRun(MigrateOptions(workload=parse_workload("idle"), testbed=False,
                                run_id="t1", profile="defaults"))
    cfg = lab._vm_config("src", [], incoming=False)
    assert cfg.mem_path == tmp_path / "shm" / "livemig-t1-src.ram"
    assert mode(cfg.mem_path) == 0o600
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    planted = tmp_path / "shm" / "livemig-t1-dst.ram"
    planted.write_bytes(b"")
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(SetupError):
        lab._vm_config("dst", [], incoming=True)
