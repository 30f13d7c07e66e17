"""The crash/signal matrix of ``livemig upgrade`` (attach: a plain QEMU livemig did
not start), ``long``: kill -9 and Ctrl-C (SIGINT) of livemig at each phase of a
cpr-transfer upgrade, on a real TCG guest.

Phases, each a point in livemig's code where the test's wrapper sends the signal to
livemig itself (deterministic: the windows are milliseconds wide):

- ``start``: the mode is chosen, the new QEMU not yet started;
- ``started``: the new QEMU runs, waiting for its CPR channel; ``migrate`` not yet
  issued (the old QEMU still runs the guest);
- ``transfer``: ``migrate`` issued to the old QEMU: the guest's state goes to the
  new one, which then runs it;
- ``quit``: the new QEMU runs the guest, the VM's sockets are moved aside and the
  old QEMU is about to be told to quit (the kill -9 case is
  tests/vm/test_crash_upgrade_vm.py; here it runs with SIGINT too).

The local-migration fallback (``--fallback migrate``, a VM with anonymous RAM) has
its own: ``migrating``, its new QEMU started (it binds the VM's socket paths at once,
unlike cpr-transfer's) and the migration about to begin; ``copying``, the old QEMU's
migration under way (the first ``query-migrate`` after ``migrate``: a kill -9 there
leaves QEMU to finish or fail the migration alone, the engine's guardian to settle
it); ``quit``, the migration completed and the old QEMU about to be told to quit.

After each, with ``livemig upgrade --recover`` run first after a kill -9 (the
documented remedy): exactly one QEMU process of the VM is left, it runs the guest
(nothing paused), it serves the VM's QMP path, and no aside socket is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_upgrade_vm import qemu_b, start_vm, status, stop_pid  # noqa: F401 (fixture)

from conftest import livemig_cmd
from livemig.engine.endpoint import socket_peer_pid
from livemig.upgrade import journal

pytestmark = [pytest.mark.vm, pytest.mark.long]

SIGNALS = {"kill": signal.SIGKILL, "int": signal.SIGINT}


def _default_sigint() -> None:
    """Ctrl-C as in a terminal: a test run started in the background (``cmd &`` in a
    script) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
# phase -> (the Upgrade method at whose call livemig signals itself, or the QMP
# command to the old QEMU before which it does)
PHASES = {
    "start": ("method", "_grab_taps"),
    "started": ("method", "_wait_listening"),
    "transfer": ("method", "_wait_source_done"),
    "quit": ("command", "quit"),
}
# a SIGINT here rolls the upgrade back: the old QEMU keeps the guest
ROLLED_BACK = ("start", "started", "fallback-migrating", "fallback-copying")
SETTLE_S = 20.0  # the new QEMU runs the guest / the old one quits within seconds

# livemig with a signal to itself at one point (env LM_KIND, LM_AT, LM_SIG)
WRAPPER = """
import os, signal, sys
from livemig.engine import endpoint
from livemig.upgrade import switch
kind, at, sig = os.environ["LM_KIND"], os.environ["LM_AT"], int(os.environ["LM_SIG"])
fired = []
def fire():
    if not fired:
        fired.append(1)
        os.kill(os.getpid(), sig)
if kind == "method":
    orig = getattr(switch.Upgrade, at)
    import inspect
    if inspect.iscoroutinefunction(orig):
        async def hooked(self, *a, **k):
            fire()
            return await orig(self, *a, **k)
    else:
        def hooked(self, *a, **k):
            fire()
            return orig(self, *a, **k)
    setattr(switch.Upgrade, at, hooked)
else:  # "command": before AT to the old QEMU; "after": AT = "FIRST,THEN": before
    # THEN once FIRST was sent
    orig_cmd = endpoint.Endpoint.cmd
    first, _, then = at.partition(",") if kind == "after" else ("", "", at)
    sent = []
    async def cmd(self, command, **args):
        if self.name == "old":
            if command == then and (not first or first in sent):
                fire()
            sent.append(command)
        return await orig_cmd(self, command, **args)
    endpoint.Endpoint.cmd = cmd
from livemig.cli import main
sys.exit(main(sys.argv[1:]))
"""


def vm_pids(qmp: Path) -> list[int]:
    """The QEMU processes of this VM: those with its QMP path on their command line."""
    out = []
    needle = str(qmp).encode() + b","  # -qmp unix:PATH,server=on,...
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"qemu-system" in cmdline and needle in cmdline and state != "Z":
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("phase", list(PHASES))
def test_upgrade_signal_matrix(tmp_path: Path, qemu_b: Path,  # noqa: F811
                               phase: str, sig: str) -> None:
    _signal_matrix_case(tmp_path, qemu_b, phase, sig, PHASES[phase])


# the fallback's phases (see the docstring)
FALLBACK_PHASES = {
    "migrating": ("method", "_migrate"),
    "copying": ("after", "migrate,query-migrate"),
    "quit": ("command", "quit"),
}


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("phase", list(FALLBACK_PHASES))
def test_upgrade_fallback_signal_matrix(tmp_path: Path, qemu_b: Path,  # noqa: F811
                                        phase: str, sig: str) -> None:
    _signal_matrix_case(tmp_path, qemu_b, f"fallback-{phase}", sig, FALLBACK_PHASES[phase],
                        "--fallback", "migrate")


def _signal_matrix_case(tmp_path: Path, qemu_b: Path, phase: str, sig: str,  # noqa: F811
                        hook: tuple[str, str], *extra: str) -> None:
    old, qmp = start_vm(tmp_path, shared=not extra)
    kind, at = hook
    env = {**os.environ, "LM_KIND": kind, "LM_AT": at, "LM_SIG": str(int(SIGNALS[sig]))}
    pids: list[int] = []
    try:
        assert vm_pids(qmp) == [old.pid]
        r = subprocess.run([sys.executable, "-c", WRAPPER, "upgrade", "--qmp", str(qmp),
                            "--to-qemu", str(qemu_b), *extra], capture_output=True,
                           text=True, timeout=300, env=env, preexec_fn=_default_sigint)
        sys.stderr.write(r.stderr[-3000:])
        if sig == "kill":
            assert r.returncode == -9, r.stderr[-2000:]
            time.sleep(2.0)  # what was under way when livemig died settles
            rec = subprocess.run(livemig_cmd("upgrade", "--recover"), capture_output=True,
                                 text=True, timeout=60)
            sys.stderr.write(rec.stdout + rec.stderr)
            assert rec.returncode == 0, rec.stderr
            assert "Traceback" not in rec.stderr
        else:
            # before the switch: rolled back (exit 1); from ``migrate`` on: finished
            assert "Traceback" not in r.stderr
            want = 1 if phase in ROLLED_BACK else 0
            assert r.returncode == want, r.stderr[-2000:]
        deadline = time.monotonic() + SETTLE_S
        while True:
            pids = vm_pids(qmp)
            served = socket_peer_pid(qmp) if qmp.exists() else None
            if len(pids) == 1 and served == pids[0]:
                break
            assert time.monotonic() < deadline, (pids, served, old.poll())
            time.sleep(0.2)
        assert status(qmp) == "running"
        assert not Path(journal.aside(str(qmp))).exists()
        assert journal.pending() == [] or all(str(qmp) not in j.read_text()
                                               for j in journal.pending())
        if pids[0] == old.pid:  # the old QEMU kept the guest: nothing happened to it
            # (a kill -9 mid-copy: the engine's guardian keeps the source unless the
            # destination was confirmed running)
            assert phase in ROLLED_BACK or (sig, phase) == ("kill", "fallback-copying"), phase
        else:
            assert old.wait(timeout=15) is not None
            assert Path(os.readlink(f"/proc/{pids[0]}/exe")) == qemu_b.resolve()
    finally:
        for pid in vm_pids(qmp):
            if pid != old.pid:
                stop_pid(pid)
        old.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()
