"""The evacuation's warm children (evacuate/pool.py, evacuate/worker.py): real
processes, a harmless argv (``livemig --help``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from livemig.evacuate import pool as pool_mod
from livemig.evacuate.pool import Pool


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def test_a_warm_child_runs_the_argv_it_is_given_into_its_log(tmp_path: Path) -> None:
    pool = Pool(1, _env(LIVEMIG_POOL_TEST="inherited"))
    pool.fill(5)
    assert len(pool.ready) == 1  # no more than its size
    log = tmp_path / "a.log"
    log.write_text("$ livemig --help\n")
    p = pool.run(["--help"], log, {"LIVEMIG_POOL_VM": "a"}, ["LIVEMIG_POOL_TEST"])
    assert p.wait(timeout=60) == 0
    assert pool.cold == 0
    text = log.read_text()
    assert text.startswith("$ livemig --help\n") and "usage: livemig" in text
    pool.close()


def test_a_cold_child_when_none_is_ready_and_idle_ones_end_on_close(tmp_path: Path) -> None:
    pool = Pool(2, _env())
    p = pool.run(["--help"], tmp_path / "b.log", {}, [])  # nothing warmed yet
    assert p.wait(timeout=60) == 0 and pool.cold == 1
    assert "usage: livemig" in (tmp_path / "b.log").read_text()
    pool.fill(2)
    idle = list(pool.ready)
    time.sleep(0.5)
    pool.close()
    assert [w.returncode for w in idle] == [0, 0]  # end of input: nothing started
    assert pool.ready == []


def test_a_warm_child_that_died_is_skipped(tmp_path: Path) -> None:
    pool = Pool(1, _env())
    pool.fill(1)
    pool.ready[0].kill()
    pool.ready[0].wait()
    p = pool.run(["--help"], tmp_path / "c.log", {}, [])
    assert p.wait(timeout=60) == 0 and pool.cold == 1


def test_the_vm_env_reaches_warm_and_cold_children_and_unset_only_drops_inherited(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unset`` drops what the evacuation inherited, never the VM's own variables:
    the cold path seen in its Popen arguments, the warm path in a worker whose
    livemig main is a stand-in that prints its environment."""
    seen: dict[str, dict[str, str]] = {}
    real = subprocess.Popen

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        seen["cold"] = dict(kw["env"])
        return real(["true"])
    monkeypatch.setattr(pool_mod.subprocess, "Popen", popen)
    p = Pool(1, _env(KEEP="k", DROP="inherited"))
    p.run(["x"], tmp_path / "c.log", {"DROP": "the VM's"}, ["DROP"]).wait()
    assert seen["cold"]["DROP"] == "the VM's" and seen["cold"]["KEEP"] == "k"
    p.run(["x"], tmp_path / "d.log", {}, ["DROP"]).wait()
    assert "DROP" not in seen["cold"]
    monkeypatch.undo()
    code = ("import json,os,runpy,livemig.cli as c;"
            "c.main=lambda argv:(print(json.dumps({k:os.environ.get(k) for k in "
            "('KEEP','DROP','VM')})),0)[1];"
            "runpy.run_module('livemig.evacuate.worker',run_name='__main__')")
    w = real([sys.executable, "-c", code], stdin=subprocess.PIPE,
             env=_env(KEEP="k", DROP="inherited"))
    assert w.stdin is not None
    w.stdin.write((json.dumps({"argv": [], "log": str(tmp_path / "w.log"),
                               "env": {"VM": "v"}, "unset": ["DROP"]}) + "\n").encode())
    w.stdin.close()
    assert w.wait(timeout=60) == 0
    assert json.loads((tmp_path / "w.log").read_text()) == {"KEEP": "k", "DROP": None,
                                                           "VM": "v"}


def test_a_warm_childs_status_and_output_survive_its_quick_exit(tmp_path: Path) -> None:
    """The worker leaves without the interpreter's teardown: what it printed is in
    its log and its exit status is livemig's."""
    code = ("import livemig.cli as c;"
            "c.main=lambda argv:(print('the report line'),3)[1];"
            "import runpy;runpy.run_module('livemig.evacuate.worker',run_name='__main__')")
    w = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=_env())
    assert w.stdin is not None
    w.stdin.write((json.dumps({"argv": [], "log": str(tmp_path / "w.log")}) + "\n").encode())
    w.stdin.close()
    assert w.wait(timeout=60) == 3
    assert (tmp_path / "w.log").read_text() == "the report line\n"


def test_the_drain_sees_a_childs_exit_before_its_next_poll() -> None:
    from livemig.evacuate import run
    from livemig.evacuate.schedule import MIGRATING, VmFacts

    evac = run.Evacuation.__new__(run.Evacuation)
    v = run.Vm(VmFacts("a", 1 << 27, 1 << 26, 0.0), "qemu+tcp://d/system")
    v.status, v.proc = MIGRATING, subprocess.Popen(["sleep", "0.2"])
    evac.vms = [v]
    t0 = time.monotonic()
    evac._nap(5.0)
    assert time.monotonic() - t0 < 1.0  # the exit, not the 5 s poll
    v.proc = subprocess.Popen(["sleep", "5"])
    t0 = time.monotonic()
    evac._nap(0.3)  # nothing exits: the whole nap
    assert time.monotonic() - t0 >= 0.3
    v.proc.kill()
    v.proc.wait()
