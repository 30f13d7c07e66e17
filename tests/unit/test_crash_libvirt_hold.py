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
h.RETRY_S = 0.01
calls = []
def resume(d, u, s):  # a migration job holds the domain for the first two looks
    calls.append(1)
    if len(calls) == 2:
        raise RuntimeError("cannot acquire state change lock")
    return None if len(calls) < 3 else f"RESUMED {d} on {u} (look {len(calls)}, src {s})"
h.resume_if_paused = resume
h.drop_exports = lambda d, u: f"DROPPED exports of {d} on {u}"
sys.exit(h.main(sys.argv[1:]))
"""


def _guard(tmp_path: Path, said: bytes, wait_s: float = 20.0) -> tuple[int, str]:
    spec = tmp_path / "hold.json"
    spec.write_text(json.dumps({"domain": "vm1", "dst_uri": "qemu+tls://b/system",
                                "src_uri": "qemu+tls://a/system", "wait_s": wait_s,
                                "watch_pid": os.getpid()}))
    p = subprocess.run([sys.executable, "-c", STUB, str(spec)], input=said,
                       capture_output=True, timeout=30)
    return p.returncode, p.stderr.decode()


def test_livemig_died_the_domain_is_resumed_once_no_job_holds_it(tmp_path):
    rc, log = _guard(tmp_path, b"")
    assert rc == 0, log
    assert "RESUMED vm1 on qemu+tls://b/system (look 3, src qemu+tls://a/system)" in log
    assert "cannot acquire state change lock" in log  # said once, then retried


def test_a_guard_that_never_may_resume_gives_up_and_says_so(tmp_path):
    rc, log = _guard(tmp_path, b"", wait_s=0.0)
    assert rc == 1 and "gave up" in log and "RESUMED" not in log


@pytest.mark.parametrize("said", [b"done\n", b"mismatch\ndone\n", b"mismatch\n"])
def test_decided_or_mismatch_leaves_the_domain_alone(tmp_path, said):
    rc, log = _guard(tmp_path, said)
    assert rc == 0 and "RESUMED" not in log


def test_start_and_dismiss_with_the_real_guard(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    g = hold.start("vm 1/x", "qemu+tls://b/system", "qemu+tls://a/system")
    assert g.proc is not None and g.proc.poll() is None  # waiting
    g.dismiss()
    assert g.proc.returncode == 0
    d = hold.guard_dir("vm 1/x")
    assert d.parent == tmp_path / "run" / "libvirt-hold" and "/" not in d.name
    assert "livemig decided" in (d / "hold.log").read_text()
    assert (d.stat().st_mode & 0o777) == 0o700


def test_the_comparisons_exports_go_before_the_resume(tmp_path):
    rc, log = _guard(tmp_path, b"")
    assert rc == 0 and log.index("DROPPED exports of vm1") < log.index("RESUMED")
