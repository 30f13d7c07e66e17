"""`livemig soak --path libvirt`: a libvirt domain shuttled between the testbed's two
libvirt daemons by `livemig migrate --domain`, one ledger line per verified hop.

Marked ``testbed`` and ``libvirt`` (the daemons run in the testbed's hosts); the soak
uses the patched build (its in-stream RAM digest is the hop's RAM verdict).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import INITRD, KERNEL, ROOT, livemig_cmd
from livemig import libvirt_lab, paths
from livemig.testbed import libvirtd, topology

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


@pytest.mark.long
def test_libvirt_soak_ctrl_c_leaves_the_domain_running_and_says_where(tmp_path: Path) -> None:
    """Ctrl-C in the second hop: the hop under way is aborted (or, if it had just
    completed, written), the soak exits 130, and the domain runs on the host the
    message names; the test then removes it and the testbed the soak left up."""
    was_up = topology.is_up()
    daemons_were_up = [s for s in libvirtd.SIDES if libvirtd.is_running(s)]
    ledger = tmp_path / "soak.jsonl"
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        proc = subprocess.Popen(livemig_cmd("soak", "--path", "libvirt", "--hops", "3",
                                            "--ledger", str(ledger)),
                                stdout=subprocess.PIPE, stderr=f, text=True)
    name = None
    try:
        end = time.monotonic() + 600
        while "[1/3]" not in err.read_text() and time.monotonic() < end:
            assert proc.poll() is None, err.read_text()
            time.sleep(0.2)
        time.sleep(3.0)  # into hop 2's migration (1 s warm-up first)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=300)
        text = err.read_text()
        print(text)
        assert proc.returncode == 130, text
        m = re.search(r"the domain (livemig-soak-\w+) runs on (src|dst) \(", text)
        assert m, text
        name = m.group(1)
        assert libvirt_lab.where(name) == {m.group(2): "running"}
        es = [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]
        assert 1 <= len(es) <= 2 and all(e["outcome"] == "completed" for e in es)
        assert es[-1]["to"] == m.group(2)
    finally:
        if proc.poll() is None:
            proc.kill()
        if name:
            libvirt_lab.remove_domain(name)
            for side in libvirtd.SIDES:
                libvirtd.image_path(side, f"{name}.img").unlink(missing_ok=True)
            # the hops' reports, kept with the domain
            shutil.rmtree(paths.run_root() / name.removeprefix("livemig-soak-"),
                          ignore_errors=True)
        with topology.locked():  # what the soak left up for its domain
            if not was_up:
                topology.down(quiet=True)
            elif not daemons_were_up:
                libvirtd.down()
    assert not _soak_domains()
