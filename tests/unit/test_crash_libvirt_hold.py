"""The libvirt hold guard: a domain held paused for the copied-disk comparison is
resumed if livemig dies during it, never after a mismatch, never once livemig
decided (the guard as a real process; libvirt replaced by a recording stub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from livemig.virt import hold

STUB = """
import sys
import livemig.virt.hold as h
h.resume_if_paused = lambda d, u: f"RESUMED {d} on {u}"
h.drop_exports = lambda d, u: f"DROPPED exports of {d} on {u}"
sys.exit(h.main(sys.argv[1:]))
"""


def _guard(tmp_path: Path, said: bytes) -> str:
    spec = tmp_path / "hold.json"
    spec.write_text(json.dumps({"domain": "vm1", "dst_uri": "qemu+tls://b/system",
                                "watch_pid": os.getpid()}))
    p = subprocess.run([sys.executable, "-c", STUB, str(spec)], input=said,
                       capture_output=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stderr.decode()


def test_livemig_died_during_the_comparison_the_domain_is_resumed(tmp_path):
    log = _guard(tmp_path, b"")
    assert "RESUMED vm1 on qemu+tls://b/system" in log
    # the comparison's NBD exports go first
    assert log.index("DROPPED exports of vm1") < log.index("RESUMED")


@pytest.mark.parametrize("said", [b"done\n", b"mismatch\ndone\n", b"mismatch\n"])
def test_decided_or_mismatch_leaves_the_domain_alone(tmp_path, said):
    log = _guard(tmp_path, said)
    assert "RESUMED" not in log and "DROPPED" not in log


def test_start_and_dismiss_with_the_real_guard(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    g = hold.start("vm 1/x", "qemu+tls://b/system")
    assert g.proc is not None and g.proc.poll() is None  # waiting
    g.dismiss()
    assert g.proc.returncode == 0
    d = hold.guard_dir("vm 1/x")
    assert d.parent == tmp_path / "run" / "libvirt-hold" and "/" not in d.name
    assert "livemig decided" in (d / "hold.log").read_text()
    assert (d.stat().st_mode & 0o777) == 0o700
