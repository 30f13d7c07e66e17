"""``livemig upgrade`` (attach) killed while the old QEMU quits: the VM's sockets
were moved aside for that moment. The journal and ``livemig upgrade --recover`` put
them back (the old QEMU, still there, goes first); the guest runs in the new QEMU,
reachable at its QMP path again. Real TCG guest, a real kill -9 of livemig at the
moment it tells the old QEMU to quit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_upgrade_vm import qemu_b, start_vm, status, stop_pid  # noqa: F401 (fixture)

from conftest import livemig_cmd
from livemig.engine.endpoint import socket_peer_pid
from livemig.upgrade import journal

pytestmark = pytest.mark.vm

# livemig, with the old QEMU's ``quit`` replaced by a kill -9 of livemig itself:
# the renames are done, the journal written, the old QEMU not yet told to quit
KILLED_AT_QUIT = """
import os, signal, sys
from livemig.engine import endpoint
orig = endpoint.Endpoint.cmd
async def cmd(self, command, **args):
    if command == "quit" and self.name == "old":
        os.kill(os.getpid(), signal.SIGKILL)
    return await orig(self, command, **args)
endpoint.Endpoint.cmd = cmd
from livemig.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_killed_while_the_old_qemu_quits_then_recover(tmp_path, qemu_b):  # noqa: F811
    old, qmp = start_vm(tmp_path, shared=True)
    new_pid = None
    try:
        r = subprocess.run([sys.executable, "-c", KILLED_AT_QUIT, "upgrade", "--quiet",
                            "--qmp", str(qmp), "--to-qemu", str(qemu_b)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == -9, r.stderr[-2000:]
        aside = Path(journal.aside(str(qmp)))
        assert not qmp.exists() and aside.exists()  # what the kill left
        new_pid = socket_peer_pid(aside)
        assert new_pid is not None and new_pid != old.pid
        assert old.poll() is None  # never told to quit
        # the next upgrade of this VM says what to do
        again = subprocess.run(livemig_cmd("upgrade", "--qmp", str(qmp), "--to-qemu",
                                           str(qemu_b)), capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 2 and "livemig upgrade --recover" in again.stderr
        rec = subprocess.run(livemig_cmd("upgrade", "--recover"), capture_output=True,
                             text=True, timeout=60)
        assert rec.returncode == 0, rec.stderr
        assert f"put back {qmp}" in rec.stdout
        assert old.wait(timeout=15) is not None  # the old QEMU went first
        assert qmp.exists() and not aside.exists()
        assert socket_peer_pid(qmp) == new_pid  # its exit did not unlink the new socket
        assert status(qmp) == "running"
        time.sleep(0.5)
        assert Path(os.readlink(f"/proc/{new_pid}/exe")) == qemu_b.resolve()
    finally:
        stop_pid(new_pid)
        old.kill()
        for f in Path("/dev/shm").glob(f"livemig-test-{os.getpid()}-*"):
            f.unlink()
