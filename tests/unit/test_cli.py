"""The CLI's error paths: one line on stderr, exit status 2, never a traceback."""

import subprocess
import sys

import pytest


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "livemig.cli", *args], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.mark.parametrize("args", [
    ["migrate", "--workload", "mem:size=1Z"],
    ["migrate", "--memory", "lots"],
    ["migrate", "--memory", "64M"],
    ["migrate", "--profile", "nope"],
    ["migrate", "--set", "novalue"],
    ["migrate", "--max-time", "-1"],
    ["migrate", "--accel", "xen"],
    ["migrate", "--bogus"],
    ["migrate", "--inject-fault", "ram-byte@0x1000"],
    ["migrate", "--qemu-trace", "bitmap,enable=x"],
])
def test_bad_input_is_one_line_exit_2(args):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("livemig: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_fault_injection_refused_without_env():
    r = _run("migrate", "--inject-fault", "ram-byte@0x1000")
    assert "LIVEMIG_ALLOW_FAULT_INJECTION" in r.stderr


def test_settings_lists_profiles():
    r = _run("settings")
    assert r.returncode == 0 and "profile upstream:" in r.stdout
