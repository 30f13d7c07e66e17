"""`livemig soak --path libvirt`: a libvirt domain shuttled between the testbed's two
libvirt daemons by `livemig migrate --domain`, one ledger line per verified hop.

Marked ``testbed`` and ``libvirt`` (the daemons run in the testbed's hosts); the soak
uses the patched build (its in-stream RAM digest is the hop's RAM verdict).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import INITRD, KERNEL, ROOT, livemig_cmd

pytestmark = [pytest.mark.testbed, pytest.mark.libvirt]
PATCHED = ROOT / "build" / "qemu" / "qemu-system-x86_64"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for p in (PATCHED, KERNEL, INITRD):
        if not p.exists():
            return f"{p} missing (make qemu, make guest)"
    if shutil.which("libvirtd") is None:
        return "libvirtd missing: make deps"
    return None


if _missing() and not os.environ.get("CI"):  # in CI a missing piece is a failure
    pytestmark.append(pytest.mark.skip(reason=str(_missing())))


def _soak_domains() -> list[str]:
    """QEMUs of a soak domain still running (there must be none after the soak)."""
    out = subprocess.run(["pgrep", "-af", "guest=livemig-soak-"], capture_output=True,
                         text=True)
    return [ln for ln in out.stdout.splitlines() if "qemu-system" in ln]


def test_libvirt_soak_shared_then_copied_hop(tmp_path: Path) -> None:
    """Two hops of the libvirt catalogue: shared storage src -> dst, then copied
    storage dst -> src; RAM (in-stream digest), disk (NBD comparison) and the guest's
    checker all ok, and the domain gone afterwards."""
    ledger = tmp_path / "soak.jsonl"
    p = subprocess.run(livemig_cmd("soak", "--path", "libvirt", "--hops", "2",
                                   "--ledger", str(ledger)),
                       capture_output=True, text=True, timeout=1200)
    print(p.stdout, p.stderr[-6000:])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    es = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
    assert [e["hop"] for e in es] == [1, 2]
    assert [e["combination"] for e in es] == ["libvirt-checker-plain",
                                              "libvirt-checker-zstd-copy"]
    assert [e["features"]["path"] for e in es] == ["libvirt", "libvirt"]
    assert [e["features"]["storage"] for e in es] == ["shared", "copy"]
    assert [(e["from"], e["to"]) for e in es] == [("src", "dst"), ("dst", "src")]
    for e in es:
        assert e["outcome"] == "completed", e
        assert e["verdicts"]["ram"] == "ok" and e["verdicts"]["checker"] == "ok", e
        assert e["mismatches"] == 0 and not e["guest_lost"] and e["fault"] is None
        assert e["timings"]["guest_pause_ms"] is not None
    assert es[1]["verdicts"]["disk"] == "ok"
    assert not _soak_domains()
    s = subprocess.run(livemig_cmd("soak", "--summarize", str(ledger)), capture_output=True,
                       text=True, timeout=60)
    assert s.returncode == 0 and "2 hops over 2 combinations, 2 ok, 0 mismatches" in s.stdout
