"""``livemig migrate --domain`` option checks: one-line errors, exit 2, before any
connection is opened (no libvirt daemon needed)."""

from __future__ import annotations

import pytest

from livemig.cli import main


@pytest.mark.parametrize("args,needle", [
    (["--domain", "x"], "--domain needs --connect SRC_URI and --to DST_URI"),
    (["--domain", "x", "--connect", "qemu+tcp://a/system"], "--domain needs"),
    (["--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system"],
     "go with --domain"),
    (["--domain", "x", "--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--workload", "idle"], "--workload is for lab runs"),
    (["--domain", "x", "--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--max-time", "0"], "--max-time must be positive"),
    (["--domain", "x", "--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--inject-fault", "disk-byte@0x10"], "LIVEMIG_ALLOW_FAULT_INJECTION"),
    (["--domain", "x", "--connect", "qemu+tcp://a/system", "--to", "qemu+tcp://b/system",
      "--set", "nonsense"], "bad --set"),
])
def test_bad_domain_options_are_one_line_errors(
        args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIVEMIG_ALLOW_FAULT_INJECTION", raising=False)
    assert main(["migrate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
