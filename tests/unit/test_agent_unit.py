"""Runs the guest agent's C unit tests (spec parser, page contents, checker)."""

import subprocess
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "guest" / "agent"


def test_agent_c_unit_tests(tmp_path):
    r = subprocess.run(["make", "-s", "-C", str(AGENT), f"OUT={tmp_path}", "check"],
                       capture_output=True, text=True, timeout=300)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    assert r.stdout.strip().splitlines()[-1].endswith(" 0 failed")
