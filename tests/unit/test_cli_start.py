"""livemig's start: a command imports its own module, not every command's (a cold
``livemig migrate`` spent 1.3 s importing them all; every evacuation child paid it)."""

from __future__ import annotations

import subprocess
import sys

from livemig import cli

PROBE = ("import sys, livemig.cli as c; c._build_parser({cmd!r}); "
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('livemig.') "
         "and m.endswith('.cli') or m == 'cryptography')))")


def _loaded(cmd: str | None) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(cmd=cmd)], check=True,
                         capture_output=True, text=True).stdout
    return set(out.split())


def test_a_command_loads_only_its_own_module() -> None:
    assert _loaded("migrate") == {"livemig.cli"}  # built in: no registered module
    assert _loaded("doctor") == {"livemig.cli", "livemig.doctor.cli"}
    assert _loaded("pki") >= {"livemig.tls.cli", "cryptography"}
    assert "livemig.soak.cli" not in _loaded("pki")


def test_help_and_unknown_commands_list_every_command() -> None:
    everything = {"livemig.cli", *cli.REGISTERED.values(), "cryptography"}
    assert _loaded(None) >= everything - {"livemig.testbed.cli"}
    assert _loaded("nosuch") >= everything - {"livemig.testbed.cli"}
    names = set(cli._build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert names >= set(cli.REGISTERED) - {"testbed"} | cli.BUILT_IN


def test_the_command_is_the_first_word_that_is_not_an_option() -> None:
    assert cli.command_of(["-v", "migrate", "--domain", "x"]) == "migrate"
    assert cli.command_of(["--help"]) is None
    assert cli.command_of([]) is None
