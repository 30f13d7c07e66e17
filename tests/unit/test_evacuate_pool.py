"""The evacuation's warm children (evacuate/pool.py, evacuate/worker.py): real
processes, a harmless argv (``livemig --help``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

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
