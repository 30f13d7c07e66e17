"""The upgrade's rename journal: sockets moved aside while the old QEMU quits go
back with ``livemig upgrade --recover`` after a livemig that died in between, and the
old QEMU, if it is still there, goes first (real files and processes, no QEMU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from livemig.cli import main
from livemig.upgrade import journal


@pytest.fixture
def run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "run"
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(root))
    return root


def _sock(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen()
    return s


def _killed_mid_quit(run_root: Path, tmp_path: Path, old_pid: int | None = None
                     ) -> tuple[Path, list[Path], list[socket.socket]]:
    """What a livemig killed while the old QEMU quits leaves: a journal, the VM's
    sockets at their aside names."""
    paths = [tmp_path / "vm.qmp", tmp_path / "vm.serial"]
    socks = [_sock(p) for p in paths]
    work = run_root / "upgrade-u1234567"
    j = journal.write(work, [(str(p), journal.aside(str(p))) for p in paths], old_pid)
    data = json.loads(j.read_text())
    data["pid"] = 999999999  # that livemig is dead
    j.write_text(json.dumps(data))
    for p in paths:
        os.rename(p, journal.aside(str(p)))
    return j, paths, socks


def test_recover_puts_the_sockets_back_and_removes_the_journal(run_root, tmp_path, capsys):
    j, paths, socks = _killed_mid_quit(run_root, tmp_path)
    assert journal.pending() == [j]
    assert main(["upgrade", "--recover"]) == 0
    out = capsys.readouterr().out
    for p in paths:
        assert p.exists() and not Path(journal.aside(str(p))).exists()
        assert f"put back {p}" in out
    assert not j.exists() and journal.pending() == []
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(paths[0]))  # the same listening socket as before
    s.close()
    for x in socks:
        x.close()
    assert main(["upgrade", "--recover"]) == 0
    assert "nothing to recover" in capsys.readouterr().out


def test_recover_never_overwrites_a_path_taken_again(run_root, tmp_path, capsys):
    j, paths, socks = _killed_mid_quit(run_root, tmp_path)
    paths[0].write_text("the user's own file")
    assert main(["upgrade", "--recover"]) == 0
    assert paths[0].read_text() == "the user's own file"
    assert Path(journal.aside(str(paths[0]))).exists()
    assert paths[1].exists()
    assert j.exists()  # something is left to put back by hand
    assert "could not be put back" in capsys.readouterr().err
    for x in socks:
        x.close()


def test_the_old_qemu_still_there_goes_before_the_sockets_come_back(run_root, tmp_path):
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _j, paths, socks = _killed_mid_quit(run_root, tmp_path, old.pid)
        assert main(["upgrade", "--recover"]) == 0
        assert old.wait(timeout=5) == -15  # SIGTERM
        assert all(p.exists() for p in paths)
    finally:
        old.kill()
        old.wait()
    for x in socks:
        x.close()


def test_a_reused_pid_is_not_killed(run_root, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j, paths, socks = _killed_mid_quit(run_root, tmp_path, other.pid)
        data = json.loads(j.read_text())
        data["old_start"] = "1"  # another process had that pid
        j.write_text(json.dumps(data))
        assert main(["upgrade", "--recover"]) == 0
        assert other.poll() is None and all(p.exists() for p in paths)
    finally:
        other.kill()
        other.wait()
    for x in socks:
        x.close()


def test_upgrading_a_vm_whose_socket_is_aside_says_recover(run_root, tmp_path, capsys):
    _j, paths, socks = _killed_mid_quit(run_root, tmp_path)
    qemu = tmp_path / "qemu"
    qemu.write_text("")
    assert main(["upgrade", "--qmp", str(paths[0]), "--to-qemu", str(qemu)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "livemig upgrade --recover" in err[0], err
    for x in socks:
        x.close()


def test_a_journal_of_a_live_livemig_is_not_touched(run_root, tmp_path):
    paths = [tmp_path / "vm.qmp"]
    journal.write(run_root / "upgrade-ulive", [(str(paths[0]), journal.aside(str(paths[0])))])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j = run_root / "upgrade-ulive" / journal.JOURNAL
        data = json.loads(j.read_text())
        data["pid"] = live.pid
        j.write_text(json.dumps(data))
        assert journal.pending() == []
    finally:
        live.kill()
        live.wait()


def test_upgrade_without_to_qemu_or_recover_is_one_line(run_root, capsys):
    assert main(["upgrade", "--qmp", "/nonexistent.qmp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--to-qemu BIN is required" in err[0]


def test_an_interrupt_before_the_switch_touches_nothing(tmp_path):
    """Ctrl-C / SIGTERM before the switch: Interrupted, no work directory, no new
    QEMU started, nothing set on the old one."""
    import asyncio

    from livemig.engine.run import Interrupted
    from livemig.upgrade.switch import Request, Upgrade

    class Old:
        name = "old"
        socket_path = tmp_path / "vm.qmp"
        pid = os.getpid()

        def __init__(self) -> None:
            self.calls: list[str] = []

        async def cmd(self, command: str, **args: object) -> object:
            self.calls.append(command)
            return {"status": "running"} if command == "query-status" else {}

    old = Old()
    stop = asyncio.Event()
    stop.set()
    up = Upgrade(old, Request(to_qemu=Path("/bin/true"), mode="migrate",  # type: ignore[arg-type]
                              work_dir=tmp_path / "work"), interrupt=stop)
    with pytest.raises(Interrupted, match="the old QEMU runs the guest"):
        asyncio.run(up.run())
    assert not (tmp_path / "work").exists()
    assert set(old.calls) <= {"query-status", "query-migrate"}  # only looked


# -- a livemig killed during the switch (the journal has no renames yet) ----------------
def _switch_journal(run_root: Path, qmp: Path, old_pid: int, new_pid: int,
                    moves: list[tuple[str, str]] | None = None) -> Path:
    j = journal.write(run_root / "upgrade-u7654321", moves or [], old_pid,
                      new_pid=new_pid, qmp=str(qmp), phase=journal.SWITCH)
    data = json.loads(j.read_text())
    data["pid"] = 999999999  # that livemig is dead
    j.write_text(json.dumps(data))
    return j


def test_recover_kills_a_new_qemu_that_never_got_the_guest(run_root, tmp_path, capsys):
    """The new process does not serve the VM's QMP path (cpr-transfer: it never got
    the CPR state): it goes; the old one (here: this process's socket) is untouched."""
    qmp = tmp_path / "vm.qmp"
    served = _sock(qmp)
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    new = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j = _switch_journal(run_root, qmp, old.pid, new.pid)
        assert journal.pending() == [j]
        assert main(["upgrade", "--recover"]) == 0
        out = capsys.readouterr().out
        assert f"killed the new QEMU (pid {new.pid})" in out, out
        assert new.wait(timeout=10) == -9
        assert old.poll() is None and qmp.exists()  # the old one and its socket stay
        assert not j.exists() and journal.pending() == []
    finally:
        served.close()
        for p in (old, new):
            p.kill()
            p.wait()


def test_recover_leaves_the_old_qemu_when_the_new_one_is_gone(run_root, tmp_path, capsys):
    qmp = tmp_path / "vm.qmp"
    served = _sock(qmp)
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    new = subprocess.Popen([sys.executable, "-c", "pass"])
    new.wait()
    try:
        j = _switch_journal(run_root, qmp, old.pid, new.pid)
        assert main(["upgrade", "--recover"]) == 0
        assert "is gone: the old one" in capsys.readouterr().out
        assert old.poll() is None  # a switch journal never ends the old QEMU by itself
        assert not j.exists()
    finally:
        served.close()
        old.kill()
        old.wait()


def test_a_switch_journal_alone_ends_no_process(run_root, tmp_path):
    """journal.recover (the renames' part) on a journal without renames: nothing."""
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j = _switch_journal(run_root, tmp_path / "vm.qmp", old.pid, old.pid)
        assert journal.recover(j) == []
        assert old.poll() is None and j.exists()
    finally:
        old.kill()
        old.wait()


def test_recover_puts_back_what_the_fallback_moved_aside_before_the_new_qemu(
        run_root, tmp_path, capsys):
    """The local-migration fallback moves the old QEMU's sockets aside before the new
    QEMU starts (it binds the same paths at once); the new one died (kill -9 of both:
    its dead socket is at the path): the dead socket goes, the old one's comes back."""
    qmp = tmp_path / "vm.qmp"
    old_sock = _sock(qmp)
    os.rename(qmp, journal.aside(str(qmp)))
    dead = _sock(qmp)
    dead.close()  # closed, the file stays: nobody accepts on it
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    new = subprocess.Popen([sys.executable, "-c", "pass"])
    new.wait()
    try:
        j = _switch_journal(run_root, qmp, old.pid, new.pid,
                            [(str(qmp), journal.aside(str(qmp)))])
        assert main(["upgrade", "--recover"]) == 0
        assert f"put back {qmp}" in capsys.readouterr().out
        assert not Path(journal.aside(str(qmp))).exists() and not j.exists()
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(qmp))  # the old QEMU's listening socket again
        s.close()
        assert old.poll() is None
    finally:
        old_sock.close()
        old.kill()
        old.wait()


def test_put_back_before_switch_never_overwrites_a_live_path(tmp_path):
    qmp = tmp_path / "vm.qmp"
    aside = journal.aside(str(qmp))
    Path(aside).write_text("the old one's")
    qmp.write_text("the user's own file")
    restored, left = journal.put_back_before_switch([(str(qmp), aside)])
    assert restored == [] and left
    assert qmp.read_text() == "the user's own file" and Path(aside).exists()
