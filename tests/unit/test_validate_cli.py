"""Everything validated before anything boots: sizes, rates, intervals, and every
--set key against what the QEMU binary offers (asked once, cached). Real binary, no
guest: each bad input costs about a second and is one line, exit status 2."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import QEMU
from livemig import qemucaps
from livemig.errors import SetupError, UsageError

FAST_S = 8.0  # generous for a loaded 2-core host; a guest boot takes far longer


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LIVEMIG_RUN_DIR": str(tmp / "run")}
    return subprocess.run([sys.executable, "-m", "livemig.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


needs_qemu = pytest.mark.skipif(not QEMU.exists(), reason="no QEMU build")


@needs_qemu
@pytest.mark.parametrize("args,msg", [
    (["--memory", "100T"], "more than this host's RAM"),
    (["--max-time", "nan"], "positive number of seconds"),
    (["--max-time", "inf"], "positive number of seconds"),
    (["--max-time", "-1"], "positive number of seconds"),
    (["--max-time", "0"], "positive number of seconds"),
    (["--set", "poll-interval=0"], "bad --set poll-interval=0"),
    (["--set", "poll-interval=-1"], "bad --set poll-interval=-1"),
    (["--set", "poll-interval=nan"], "bad --set poll-interval=nan"),
    (["--set", "warmup=inf"], "bad --set warmup=inf"),
    (["--set", "max-downtime=0"], "bad --set max-downtime=0"),
    (["--bandwidth", "0"], "--bandwidth must be positive"),
    (["--bandwidth=-5M"], "bad --bandwidth"),
    (["--disk-size", "0"], "--disk-size must be at least 1M"),
    (["--link", "0.5kbit"], "between 1mbit and 400gbit"),
    (["--set", "multifd-channelz=4"], "unknown setting 'multifd-channelz'"),
    (["--set", "multifd-channelz=4"], "did you mean 'multifd-channels'?"),
    (["--set", "multifd=maybe"], "bad --set multifd=maybe"),
    (["--set", "downtime-limit=soon"], "bad --set downtime-limit"),
])
def test_bad_input_fails_in_about_a_second_before_anything_boots(args, msg, tmp_path):
    t0 = time.monotonic()
    r = _run("migrate", "--workload", "idle", *args, tmp=tmp_path)
    took = time.monotonic() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("livemig: error:"), r.stderr
    assert msg in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert took < FAST_S, took
    assert not (tmp_path / "run").exists() or not any(
        p.is_dir() and p.name != "qemu-caps" for p in (tmp_path / "run").iterdir())


@needs_qemu
def test_a_binary_that_is_not_qemu_is_one_line(tmp_path):
    r = _run("migrate", "--workload", "idle", "--qemu", "/bin/true", tmp=tmp_path)
    assert r.returncode == 2 and "not a QEMU that answers migration queries" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run("migrate", "--workload", "idle", "--qemu", str(tmp_path / "nope"), tmp=tmp_path)
    assert r.returncode == 2 and "QEMU binary not found" in r.stderr


@needs_qemu
def test_the_binarys_answer_is_cached_per_binary_privately(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    assert not qemucaps.cached(QEMU)
    k = qemucaps.knobs(QEMU)
    assert "multifd" in k.capabilities and "downtime-limit" in k.parameters
    assert qemucaps.cached(QEMU)
    files = list(qemucaps.cache_dir().iterdir())
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(qemucaps.cache_dir().stat().st_mode) == 0o700

    def no_probe(binary: Path) -> qemucaps.MigrationKnobs:
        raise AssertionError("asked the binary again")

    monkeypatch.setattr(qemucaps, "probe", no_probe)
    qemucaps.check_settings(QEMU, {"multifd-channels": "3", "multifd": "on",
                                   "poll-interval": "0.5"})
    with pytest.raises(UsageError, match="unknown setting 'xbzrl'"):
        qemucaps.check_settings(QEMU, {"xbzrl": "on"})


def test_a_rebuilt_binary_is_asked_again(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    fake = tmp_path / "qemu"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    calls = []

    def probe(binary: Path) -> qemucaps.MigrationKnobs:
        calls.append(binary)
        return qemucaps.MigrationKnobs({"multifd": False}, {"downtime-limit": 300})

    monkeypatch.setattr(qemucaps, "probe", probe)
    qemucaps.knobs(fake)
    qemucaps.knobs(fake)
    assert len(calls) == 1
    fake.write_text("#!/bin/sh\nexit 2\n")  # size changes: another binary
    qemucaps.knobs(fake)
    assert len(calls) == 2


def test_probe_of_a_non_qemu_is_a_setup_error():
    with pytest.raises(SetupError, match="not a QEMU"):
        qemucaps.probe(Path("/bin/true"))


def test_upgrade_to_a_binary_that_is_not_qemu_is_refused_first(tmp_path):
    import socket

    sock = socket.socket(socket.AF_UNIX)  # a VM's QMP socket, as far as the checks go
    sock.bind(str(tmp_path / "vm.qmp"))
    r = _run("upgrade", "--qmp", str(tmp_path / "vm.qmp"), "--to-qemu", "/bin/true",
             tmp=tmp_path)
    sock.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "not a QEMU that answers migration queries" in lines[0]


# A QEMU built without GnuTLS, as far as the probe sees it: the real binary's QMP
# answers, except that TLS credentials cannot be created (QEMU's own message).
NO_GNUTLS_QEMU = """#!{python}
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    ask, mid = msg["execute"], msg.get("id")
    if ask == "query-migrate-capabilities":
        out = {{"return": [{{"capability": "multifd", "state": False}}]}}
    elif ask == "query-migrate-parameters":
        out = {{"return": {{"downtime-limit": 300, "multifd-channels": 2}}}}
    elif ask == "object-add":
        out = {{"error": {{"class": "GenericError",
                          "desc": "TLS credentials support requires GNUTLS"}}}}
    else:
        out = {{"return": {{}}}}
    if mid is not None:
        out["id"] = mid
    print(json.dumps(out), flush=True)
    if ask == "quit":
        break
"""


def _no_gnutls_qemu(tmp: Path) -> Path:
    fake = tmp / "qemu-no-gnutls"
    fake.write_text(NO_GNUTLS_QEMU.format(python=sys.executable))
    fake.chmod(0o755)
    return fake


def test_probe_tells_a_qemu_without_gnutls(tmp_path):
    assert qemucaps.probe(_no_gnutls_qemu(tmp_path)).gnutls is False


@needs_qemu
def test_the_real_binary_has_gnutls():
    assert qemucaps.probe(QEMU).gnutls is True


def test_tls_on_with_a_qemu_without_gnutls_fails_before_anything_boots(tmp_path):
    fake = _no_gnutls_qemu(tmp_path)
    t0 = time.monotonic()
    r = _run("migrate", "--workload", "idle", "--link", "local", "--tls", "on",
             "--qemu", str(fake), tmp=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "built without GnuTLS" in lines[0], r.stderr
    assert "--tls off" in lines[0]
    assert time.monotonic() - t0 < FAST_S
    # nothing booted: no run directory besides the capability cache
    assert not any(p.is_dir() and p.name != "qemu-caps" for p in (tmp_path / "run").iterdir())


def test_tls_off_with_a_qemu_without_gnutls_is_not_refused_for_it(tmp_path, monkeypatch):
    """The negative: the check is about TLS only (--tls off passes validation)."""
    from livemig import cli

    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path / "run"))
    fake = _no_gnutls_qemu(tmp_path)
    a = cli._build_parser().parse_args(["migrate", "--workload", "idle", "--link", "local",
                                        "--tls", "off", "--qemu", str(fake)])
    assert cli._migrate_options(a).qemu == fake
    a = cli._build_parser().parse_args(["migrate", "--workload", "idle", "--link", "local",
                                        "--tls", "on", "--qemu", str(fake)])
    with pytest.raises(UsageError, match="without GnuTLS"):
        cli._migrate_options(a)
