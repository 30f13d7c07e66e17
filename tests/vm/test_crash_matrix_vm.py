"""The crash/signal matrix (``long``): kill -9, Ctrl-C (SIGINT) and SIGTERM of
livemig at each phase, for the lab and the attach entry points, on real TCG guests.

Phases, each found by a line livemig prints:

- ``applied``: settings applied and the destination listening, ``migrate`` not yet
  issued (the lab's warm-up; attach has no such window: it goes from the last
  setting to ``migrate`` in one QMP round trip, covered by the engine's unit tests);
- ``throttled``: an active migration with livemig's throttle holding the guest
  (patched QEMU; mid-copy on a stock one);
- ``verifying``: the copy completed, both ends paused, the RAM comparison running;
- ``running``: the guest runs on the destination, livemig not yet done (the lab's
  settle time; for attach a narrow window: the case may land just after it).

After each, whatever the phase: the guest runs on exactly one side, without a
throttle, with every setting livemig changed put back (attach: the user's QEMUs),
a destination that never held the guest is gone (its port closed), and nothing of
the run is left once the next command has reaped (lab). The representative case in
``make test`` is tests/vm/test_crash_vm.py (lab, kill -9, throttled).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import QEMU, livemig_cmd, new_run_id, qemu_pids
from livemig import paths, qemucaps
from qemuhelp import (
    free_port,
    guest_progress,
    has_command,
    qmp,
    read_until,
    start_qemu,
    stop,
    throttle_left,
)

pytestmark = [pytest.mark.vm, pytest.mark.long]

SIGNALS = {"kill": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}
REPAIR_S = 60.0  # the guardian connects, cancels and restores within seconds
EXIT_S = 120.0   # livemig winds down after SIGINT/SIGTERM (cancel, restore, stop QEMUs)

# the line that says livemig is in the phase, and how long to wait after it
LAB_PHASES: dict[str, tuple[str, float]] = {
    "applied": ("measuring the workload's normal rate", 1.0),
    "throttled": (r"throttle [1-9]\d*%|migration started", 0.5),
    "verifying": ("comparing guest RAM", 0.0),
    "running": ("the guest runs on the destination", 1.0),
}
ATTACH_PHASES = {k: v for k, v in LAB_PHASES.items() if k != "applied"}


def _status(sock: Path) -> str | None:
    """The runstate, or None when that QEMU is gone (or its socket)."""
    try:
        return str(qmp(sock, "query-status", timeout=10)["status"])
    except Exception:
        return None


def _one_side_runs(src: Path, dst: Path, deadline_s: float) -> tuple[str | None, str | None]:
    """Wait until exactly one side runs and the source's migration is over."""
    deadline = time.monotonic() + deadline_s
    while True:
        s, d = _status(src), _status(dst)
        mig = qmp(src, "query-migrate").get("status") if s is not None else None
        if [s, d].count("running") == 1 and mig in (None, "none", "completed", "cancelled",
                                                    "failed"):
            return s, d
        assert time.monotonic() < deadline, (s, d, mig)
        time.sleep(0.5)


def _guardian_runs(src: Path) -> list[Path]:
    """livemig's attach run directories whose guardian watched the QEMU on ``src``."""
    return [p for p in paths.run_root().glob("a*") if (p / "guardian.json").exists()
            and json.loads((p / "guardian.json").read_text()).get("src") == str(src)]


def _guardian_done(run: Path) -> bool:
    log = run / "guardian.log"
    text = log.read_text() if log.exists() else ""
    return "repair " in text or "finished normally" in text


def _guardian_repaired(src: Path, deadline_s: float) -> None:
    """Wait for the guardian of the run on ``src`` to be done: its repair logged, or
    livemig's end seen (a run killed once the guest ran on the destination may have
    removed its directory already). Until then a source may run again while its
    destination, about to be quit, still answers (seen once in the attach matrix: the
    test read the destination's status, then found its socket gone)."""
    deadline = time.monotonic() + deadline_s
    while not all(_guardian_done(p) for p in _guardian_runs(src)):
        assert time.monotonic() < deadline, "the guardian never logged its end"
        time.sleep(0.2)


def _port_closed(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3):
            return False
    except OSError:
        return True


def _profile(sock_or_patched: bool) -> tuple[str, str]:
    """(profile, phase pattern for 'throttled') for a patched or stock QEMU."""
    return ("livemig", r"throttle [1-9]\d*%") if sock_or_patched else \
        ("upstream-plain", "migration started")


# -- the lab ------------------------------------------------------------------------
def _patched_build() -> bool:
    from test_crash_vm import PATCHED

    return PATCHED


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("phase", list(LAB_PHASES))
def test_lab_signal_matrix(phase: str, sig: str, tmp_path: Path) -> None:
    rid = new_run_id()
    run_dir = paths.run_root() / rid
    report = tmp_path / "r.json"
    profile, throttled = _profile(_patched_build())
    converge = phase in ("verifying", "running")
    args = ["--accel", "tcg", "--memory", "512M", "--run-id", rid, "--link", "local",
            "--profile", profile, "--max-time", "300", "--report", str(report),
            "--set", "warmup=20" if phase == "applied" else "warmup=1"]
    if converge:  # a migration that completes soon, and a settle time to be killed in
        args += ["--workload", "mem:size=64M,rate=2M", "--bandwidth", "96M",
                 "--set", "settle=15"]
    else:
        args += ["--workload", "mem:size=192M,rate=0", "--bandwidth", "8M"]
    pattern, after = LAB_PHASES[phase]
    if phase == "throttled":
        pattern = throttled
    rc, err = _signal_at(args, pattern, after, sig, 240)
    sq, dq = run_dir / "src.qmp", run_dir / "dst.qmp"
    if sig == "kill":
        log = run_dir / "guardian.log"
        deadline = time.monotonic() + REPAIR_S
        while "repair done" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.5)
        s, _d = _one_side_runs(sq, dq, 30)
        running = sq if s == "running" else dq
        assert throttle_left(running) == 0
        if s == "running":  # the source is the VM: settings back, workload on
            default = qemucaps.knobs(QEMU).parameters["max-bandwidth"]
            assert qmp(sq, "query-migrate-parameters")["max-bandwidth"] == default
            assert guest_progress(run_dir / "src.agent") > 0
            if phase in ("applied", "throttled"):  # never held the guest: quit
                gone = time.monotonic() + 10
                while _status(dq) is not None:
                    assert time.monotonic() < gone, _status(dq)
                    time.sleep(0.2)
        from livemig.lab.leftovers import reap

        reap()  # what the next livemig command does first
        assert qemu_pids(rid) == []
        assert not list(paths.shm_root().glob(f"livemig-{rid}-*"))
        assert not run_dir.exists()
        return
    # SIGINT / SIGTERM: livemig winds down itself and says where the guest was
    assert rc in (0, 3), err[-2000:]
    rep: dict[str, Any] = json.loads(report.read_text())
    if rep["outcome"] == "aborted":
        assert phase in ("applied", "throttled"), rep["reason"]
        assert rep["reason"] == "interrupted"
        if rep.get("source_after") and "running" in rep["source_after"]:
            assert rep["source_after"]["running"] is True
    else:  # a switchover under way is finished, not undone
        assert rep["outcome"] == "completed" and phase in ("verifying", "running"), rep
        after = [e for e in rep["events"] if e["event"] == "destination after"]
        assert after and after[-1]["status"] == "running", after
    assert "Traceback" not in err
    assert qemu_pids(rid) == []  # the lab's QEMUs are the lab's: stopped at its end
    assert not list(paths.shm_root().glob(f"livemig-{rid}-*"))


# -- attach -------------------------------------------------------------------------
@pytest.fixture
def pair(tmp_path: Path):
    procs: list[subprocess.Popen[bytes]] = []

    def make(workload: str) -> tuple[Any, Any, Path, Path]:
        src = start_qemu(tmp_path, "src", workload)
        dst = start_qemu(tmp_path, "dst", workload, incoming=True, paused=True)
        procs.extend([src, dst])
        time.sleep(4)
        return src, dst, tmp_path / "src.qmp", tmp_path / "dst.qmp"

    yield make
    for p in procs:
        stop(p)


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("phase", list(ATTACH_PHASES))
def test_attach_signal_matrix(pair, phase: str, sig: str, tmp_path: Path) -> None:
    converge = phase in ("verifying", "running")
    src, dst, sq, dq = pair("mem:size=32M,rate=2M" if converge else "mem:size=128M,rate=0")
    caps_before = qmp(sq, "query-migrate-capabilities")
    params_before = qmp(sq, "query-migrate-parameters")
    dcaps_before = qmp(dq, "query-migrate-capabilities")
    profile, throttled = _profile(has_command(sq, "set-cpu-throttle"))
    port = free_port()
    report = tmp_path / "r.json"
    args = ["--src-qmp", str(sq), "--dst-qmp", str(dq), "--uri", f"tcp:127.0.0.1:{port}",
            "--report", str(report), "--profile", profile, "--max-time", "300",
            "--bandwidth", "128M" if converge else "8M"]
    pattern, after = ATTACH_PHASES[phase]
    if phase == "throttled":
        pattern = throttled
    rc, err = _signal_at(args, pattern, after, sig, 180)
    if sig == "kill":  # the guardian repairs; until it is done the ends are in motion
        _guardian_repaired(sq, REPAIR_S)
    s, d = _one_side_runs(sq, dq, REPAIR_S)
    # nothing livemig changed stays, on either QEMU it did not start
    deadline = time.monotonic() + REPAIR_S
    while qmp(sq, "query-migrate-parameters") != params_before:
        assert time.monotonic() < deadline, qmp(sq, "query-migrate-parameters")
        time.sleep(0.5)
    assert qmp(sq, "query-migrate-capabilities") == caps_before
    if d is not None:
        assert qmp(dq, "query-migrate-capabilities") == dcaps_before
    if s == "running":
        assert src.poll() is None and throttle_left(sq) == 0
        assert guest_progress(tmp_path / "src.agent") > 0
        if d is None:  # quit: it never held the guest, and its port is closed
            assert dst.wait(timeout=30) == 0 and _port_closed(port)
    else:
        assert d == "running" and dst.poll() is None
        assert guest_progress(tmp_path / "dst.agent") > 0
    if sig != "kill":
        assert rc in (0, 3), err[-2000:]
        assert "Traceback" not in err
        rep = json.loads(report.read_text())
        assert (rep["outcome"] == "completed") == (d == "running"), rep["outcome"]
    # no stray run directory of livemig's (the guardian's log stays only after a repair)
    if sig != "kill":
        assert _guardian_runs(sq) == []


def _signal_at(args: list[str], pattern: str, after: float, sig: str,
               timeout: float) -> tuple[int | None, str]:
    """Run ``livemig migrate ARGS``, send ``sig`` ``after`` seconds past the first
    output line matching ``pattern``; its exit status and stderr."""
    proc = subprocess.Popen(livemig_cmd("migrate", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        read_until(proc, pattern, timeout)
        time.sleep(after)
        os.kill(proc.pid, SIGNALS[sig])
        _out, err = proc.communicate(timeout=EXIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err
