"""`livemig verify`: ping-pong between the testbed's hosts under the guest checker."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import livemig_cmd

pytestmark = pytest.mark.vm
FAULTS = {"LIVEMIG_ALLOW_FAULT_INJECTION": "1"}


def _verify(tmp_path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 900) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "verify.json"
    p = subprocess.run(livemig_cmd("verify", "--accel", "tcg", "--report", str(report), *args),
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    print(p.stdout, p.stderr[-4000:])
    assert report.exists(), p.stderr[-2000:]
    return p, json.loads(report.read_text())


def test_clean_ping_pong_across_combinations(tmp_path):
    combos = "plain,multifd-4,lz4-bypass,hot-page-defer,storage-copy,zstd"
    p, rep = _verify(tmp_path, "--rounds", "6", "--combinations", combos)
    assert p.returncode == 0
    assert rep["migrations"] == 6 and rep["completed"] == 6
    assert rep["mismatches"] == 0
    assert set(rep["by_combination"]) == set(combos.split(","))
    assert all(b["mismatches"] == 0 for b in rep["by_combination"].values())
    hops = rep["hops"]
    assert [h["from"] for h in hops] == ["src", "dst"] * 3  # really back and forth
    assert all(h["ram"] == "ok" and h["guest"] == "ok" for h in hops)
    assert [h["disk"] for h in hops if h["combination"] == "storage-copy"] == ["ok"]
    assert rep["injected"] == 0


@pytest.mark.parametrize("kind,combos", [("ram-stamped", "plain,lz4"),
                                         ("disk-stamped", "storage-copy")])
def test_every_injected_fault_is_named_by_host_and_guest(tmp_path, kind, combos):
    p, rep = _verify(tmp_path, "--rounds", "2", "--combinations", combos, "--inject", kind,
                     env=FAULTS)
    assert p.returncode == 0, p.stderr[-2000:]
    assert rep["injected"] == 2
    assert rep["detected_by_host"] == 2
    assert rep["detected_by_guest"] == 2
    assert rep["detected"] == 2
    assert rep["mismatches"] == 0  # nothing beyond what was injected
    for h in rep["hops"]:
        assert len(h["injected"]) == 1
        assert (h["ram"] if kind.startswith("ram") else h["disk"]) == "mismatch"


def test_injection_refused_unless_allowed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LIVEMIG_ALLOW_FAULT_INJECTION"}
    p = subprocess.run(livemig_cmd("verify", "--inject", "ram-stamped"), capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 2
    assert "LIVEMIG_ALLOW_FAULT_INJECTION=1" in p.stderr and "Traceback" not in p.stderr
