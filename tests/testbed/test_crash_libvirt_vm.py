"""A libvirt ``--storage copy`` run killed during the copied-disk comparison: the
destination, held paused (the source is gone under libvirt), is resumed by the hold
guard instead of staying paused for good; SIGTERM stops the comparison and livemig
resumes it itself (``long``; real libvirt daemons)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from test_libvirt_vm import _cleanup, _define, _unique, _where, daemons  # noqa: F401

from conftest import livemig_cmd
from livemig.testbed import libvirtd
from livemig.virt import hold

pytestmark = [pytest.mark.testbed, pytest.mark.libvirt, pytest.mark.long]
RESUMED_WITHIN_S = 30.0  # the guard connects to the dst daemon and resumes


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_during_the_disk_comparison_the_destination_runs(
        daemons: dict[str, str], sig: signal.Signals) -> None:  # noqa: F811
    name = _unique("lmhold")
    _define(name, "copy")
    try:
        proc = subprocess.Popen(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--storage", "copy", "--set", "disk-check=stream",
            "--max-time", "180"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = ""
        deadline = time.monotonic() + 240
        while "comparing the copied disks" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            assert proc.stderr is not None
            seen += proc.stderr.readline()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        log = hold.guard_dir(name) / "hold.log"
        deadline = time.monotonic() + RESUMED_WITHIN_S
        while _where(name)["dst"] != "running":
            assert time.monotonic() < deadline, (_where(name), log.read_text())
            time.sleep(0.5)
        if sig == signal.SIGKILL:  # the guard's resume, not livemig's
            assert "livemig died" in log.read_text()
        else:  # SIGTERM: livemig stops comparing, resumes it itself, writes its report
            assert proc.returncode == 0, seen[-2000:]
            assert "livemig decided" in log.read_text()
        assert _where(name)["src"] is None
    finally:
        _cleanup(name)
