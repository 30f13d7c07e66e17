"""Benchmark smoke: the matrix runner runs end to end and writes its files. It
asserts that the machinery works (a stock profile on the unpatched binary beside
the livemig profile, one short family, one repeat), never how fast anything was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, livemig_cmd

pytestmark = pytest.mark.vm

UPSTREAM = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"


def test_matrix_smoke_writes_table_reports_and_charts(tmp_path):
    if not UPSTREAM.exists():
        pytest.fail(f"{UPSTREAM} missing: 'make setup' builds the unpatched baseline")
    matrix = tmp_path / "smoke.toml"
    matrix.write_text(
        'profiles = ["upstream", "livemig"]\nrepeats = 1\nmemory = "256M"\n'
        'max_time = 120\nset = { warmup = "1", settle = "0.5" }\n'
        '[[family]]\nname = "smoke-a"\nworkload = "mem:size=32M,rate=8M,hot=90/10"\n'
        'link = "local"\n'
        '[[family]]\nname = "smoke-b"\nworkload = "idle"\nlink = "local"\n')
    out = tmp_path / "out"
    proc = subprocess.run(livemig_cmd("bench", str(matrix), "--out", str(out), "--accel",
                                      "tcg", "-q"),
                          capture_output=True, text=True, timeout=600)
    sys.stdout.write(proc.stdout[-3000:])
    sys.stderr.write(proc.stderr[-3000:])
    assert proc.returncode == 0
    md = (out / "summary.md").read_text()
    assert "Matrix: livemig ÷ best stock profile per family" in md
    assert "| upstream | 10.2.2 unpatched |" in md or "unpatched |" in md
    for fam in ("smoke-a", "smoke-b"):
        summary = json.loads((out / f"{fam}-summary.json").read_text())
        assert summary["upstream"]["binary"].endswith("unpatched")
        assert summary["livemig"]["binary"].endswith("patched")
        rep = json.loads((out / f"{fam}-livemig-1.json").read_text())
        assert rep["bench"]["family"] == fam and rep["outcome"] == "completed"
        assert "work_lost_s" in rep["workload"]
    assert (out / "smoke-a.png").exists() and (out / "smoke-a-ratios.png").exists()


def test_bench_refuses_a_missing_stock_binary(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text('memory = "256M"\nworkload = "idle"\nprofiles = ["upstream"]\n')
    proc = subprocess.run(livemig_cmd("bench", str(sc), "--stock-qemu",
                                      str(tmp_path / "nope")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "make qemu-upstream" in proc.stderr and "Traceback" not in proc.stderr
