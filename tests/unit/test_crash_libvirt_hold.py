"""The guard of a libvirt run: a domain held paused for the copied-disk comparison is
resumed if livemig dies during it, never after a mismatch, never once livemig
decided; what the run's journal says it set is put back once no job holds the domain
(the guard as a real process; libvirt replaced by a recording stub)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from livemig.virt import hold, journal
from livemig.virt.repair import NO_IO_LIMITS, put_back

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
looks = []
def put_back(d, record):  # a job holds the domain at the first look
    looks.append(1)
    return None if len(looks) < 2 else [f"PUT BACK {record['params']} on {d}"]
h.put_back_settings = put_back
sys.exit(h.main(sys.argv[1:]))
"""


def _guard(tmp_path: Path, said: bytes, wait_s: float = 20.0, paused: bool = True,
           journal_owner: int | None = None) -> tuple[int, str]:
    """``journal_owner``: a journal for vm1 written by that pid (None: no journal)."""
    run = tmp_path / "run"
    env = {**os.environ, "LIVEMIG_RUN_DIR": str(run)}
    if journal_owner is not None:
        p = _journal_path(run, "vm1")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"domain": "vm1", "owner_pid": journal_owner,
                                 "src_uri": "qemu+tls://a/system",
                                 "params": {"throttle-trigger-threshold": 50}}))
    spec = tmp_path / "hold.json"
    spec.write_text(json.dumps({"domain": "vm1", "dst_uri": "qemu+tls://b/system",
                                "src_uri": "qemu+tls://a/system", "wait_s": wait_s,
                                "paused": paused, "watch_pid": os.getpid()}))
    p = subprocess.run([sys.executable, "-c", STUB, str(spec)], input=said,
                       capture_output=True, timeout=30, env=env)
    return p.returncode, p.stderr.decode()


def _journal_path(run: Path, domain: str) -> Path:
    old = os.environ.get("LIVEMIG_RUN_DIR")
    os.environ["LIVEMIG_RUN_DIR"] = str(run)
    try:
        return journal.path(domain)
    finally:
        if old is None:
            del os.environ["LIVEMIG_RUN_DIR"]
        else:
            os.environ["LIVEMIG_RUN_DIR"] = old


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


def test_livemig_died_its_settings_are_put_back_once_no_job_holds_the_domain(tmp_path):
    # not a paused migration: nothing to resume, the journal's settings go back
    rc, log = _guard(tmp_path, b"", paused=False, journal_owner=os.getpid())
    assert rc == 0, log
    assert "RESUMED" not in log and "DROPPED" not in log
    assert "a migration job still holds the domain" in log
    assert "PUT BACK {'throttle-trigger-threshold': 50} on vm1" in log
    assert not _journal_path(tmp_path / "run", "vm1").exists()  # done with


def test_resumed_by_livemig_then_died_the_settings_still_go_back(tmp_path):
    rc, log = _guard(tmp_path, b"decided\n", journal_owner=os.getpid())
    assert rc == 0 and "RESUMED" not in log and "PUT BACK" in log, log


def test_a_newer_runs_journal_is_not_touched(tmp_path):
    rc, log = _guard(tmp_path, b"", paused=False, journal_owner=os.getpid() + 1)
    assert rc == 0 and "PUT BACK" not in log and "no settings of this run" in log, log
    assert _journal_path(tmp_path / "run", "vm1").exists()


def test_settings_that_cannot_go_back_in_time_are_left_to_the_next_run(tmp_path):
    rc, log = _guard(tmp_path, b"", paused=False, wait_s=0.0, journal_owner=os.getpid())
    assert rc == 1 and "the next livemig run" in log, log
    assert _journal_path(tmp_path / "run", "vm1").exists()


class FakeDom:
    def __init__(self, job: int = 0, active: bool = True, downtime: int = 300) -> None:
        self.job, self.active, self.downtime = job, active, downtime
        self.calls: list[tuple[str, dict[str, object]]] = []

    def isActive(self) -> bool:
        return self.active

    def jobInfo(self) -> list[int]:
        return [self.job]

    def migrateGetMaxDowntime(self, flags: int) -> int:
        return self.downtime

    def migrateSetMaxDowntime(self, ms: int, flags: int) -> None:
        self.downtime = ms


RECORD = {"src_uri": "A", "dst_uri": "B", "params": {"throttle-trigger-threshold": 50},
          "caps": {"return-path": False}, "io": ["/machine/peripheral/virtio-disk0"],
          "downtime_ms": 300, "dst_params": {"multifd-channels": 2}}


def _recording(monkeypatch):
    def command(dom, execute, **args):
        dom.calls.append((execute, args))
    monkeypatch.setattr("livemig.virt.repair.qmp.command", command)


def test_put_back_restores_the_source_end_where_the_domain_runs(monkeypatch):
    _recording(monkeypatch)
    src = FakeDom(downtime=2000)  # the downtime ramp had raised it
    repaired, waiting = put_back(RECORD, {"A": src, "B": None}.get, 0)
    assert waiting == [] and [r["uri"] for r in repaired] == ["A"]
    assert src.calls == [
        ("migrate-set-parameters", {"throttle-trigger-threshold": 50}),
        ("migrate-set-capabilities", {"capabilities": [
            {"capability": "return-path", "state": False}]}),
        ("block_set_io_throttle", {"id": "/machine/peripheral/virtio-disk0",
                                   **NO_IO_LIMITS})]
    assert src.downtime == 300


def test_put_back_waits_for_a_job_and_skips_an_end_the_domain_left(monkeypatch):
    _recording(monkeypatch)
    src, dst = FakeDom(job=2), FakeDom(active=True)
    repaired, waiting = put_back(RECORD, {"A": src, "B": dst}.get, 0)
    assert waiting == ["A"] and src.calls == []
    assert dst.calls == [("migrate-set-parameters", {"multifd-channels": 2})]
    gone = FakeDom(active=False)
    repaired, waiting = put_back(RECORD, {"A": gone, "B": None}.get, 0)
    assert repaired == [] and waiting == [] and gone.calls == []
