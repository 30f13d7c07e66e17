"""Shared fixtures: the integration tests run the real CLI on real TCG guests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
QEMU = ROOT / "build" / "qemu" / "qemu-system-x86_64"
KERNEL = ROOT / "build" / "guest" / "vmlinuz"
INITRD = ROOT / "build" / "guest" / "initrd.img"


# parallel runs (several checkouts on one machine) queue for the testbed
os.environ.setdefault("LIVEMIG_TESTBED_WAIT", "900")
# what a test waiting for a lab run to start must add for that queue
TESTBED_WAIT = float(os.environ["LIVEMIG_TESTBED_WAIT"])


def _have_vm_prereqs() -> str | None:
    for p in (QEMU, KERNEL, INITRD):
        if not p.exists():
            return f"{p} missing: run 'make setup'"
    if os.geteuid() != 0:
        return "needs root"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _have_vm_prereqs()
    if why is None:
        return
    # In CI a missing build is a failure, not a skip: the tests must be able to fail.
    if os.environ.get("CI"):
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "vm" in item.keywords:
            item.add_marker(skip)


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str], report: dict[str, Any]) -> None:
        self.proc = proc
        self.report = report
        self.rc = proc.returncode


def new_run_id() -> str:
    return "t" + uuid.uuid4().hex[:7]


def livemig_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "livemig.cli", *args]


def run_migrate(tmp_path: Path, *args: str, timeout: float = 400,
                env: dict[str, str] | None = None) -> Run:
    report = tmp_path / "report.json"
    cmd = livemig_cmd("migrate", "--accel", "tcg", "--report", str(report), *args)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout + TESTBED_WAIT,
                          env={**os.environ, **(env or {})})
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-4000:])
    assert report.exists(), f"no report; rc={proc.returncode}\n{proc.stderr[-2000:]}"
    return Run(proc, json.loads(report.read_text()))


def qemu_pids(run_id: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"livemig-{run_id}-"], capture_output=True,
                         text=True)
    return [int(p) for p in out.stdout.split()]
