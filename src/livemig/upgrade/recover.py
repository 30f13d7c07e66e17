"""``livemig upgrade --recover`` for an upgrade whose livemig died during the switch:
after the new QEMU was started and before the old one's sockets were moved aside.

The journal (:mod:`livemig.upgrade.journal`, written without renames as soon as the
new QEMU is started) names the new QEMU (pid, start time) and the VM's QMP path.
What is found then decides:

- the new QEMU is gone: nothing to settle (the old QEMU kept the guest, or took it
  back: QEMU resumes a source whose migration failed);
- it lives but does not serve the QMP path: with cpr-transfer the new QEMU opens its
  monitors only once the old one has sent its CPR state, so it never got the guest;
  it is killed (it would wait for that channel for good), the old QEMU runs on;
- it serves the QMP path and its guest runs: the switch happened and the old QEMU is
  paused (``postmigrate``) for good: it goes, as a finished upgrade makes it go, with
  the sockets both processes listen on moved aside while it exits (its exit unlinks
  its listening paths, which are the new QEMU's now); the journal records those
  renames first, and :func:`journal.recover` ends the old QEMU and puts them back;
- it serves the path but its guest does not run (still ``inmigrate``, or paused):
  left as it is and said; the journal stays for a later ``--recover``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from livemig.engine.endpoint import Endpoint, socket_peer_pid
from livemig.errors import LivemigError
from livemig.upgrade import journal, procfs

GONE_S = 10.0  # a QEMU killed with SIGKILL is gone in well under a second
QMP_CONNECT_S = 5.0  # the new QEMU's monitor answers at once when it serves the path


def settle(j: Path) -> list[str]:
    """Settle a journal left during the switch (no renames in it); what was done, one
    line each. A journal with renames is left to :func:`journal.recover`."""
    data = journal.read(j)
    if not data or data.get("moves"):
        return []
    new_pid, new_start = int(data.get("new_pid") or 0), data.get("new_start")
    old_pid, old_start = int(data.get("old_pid") or 0), data.get("old_start")
    qmp = data.get("qmp")
    if not new_pid or not qmp:
        _drop(j)
        return []
    if new_start is None or journal.start_time(new_pid) != new_start:
        _drop(j)
        return [f"{qmp}: the new QEMU (pid {new_pid}) is gone: nothing to settle"]
    path = Path(str(qmp))
    if socket_peer_pid(path) != new_pid:
        _kill(new_pid)
        _drop(j)
        return [f"{qmp}: killed the new QEMU (pid {new_pid}): it never got the guest; "
                f"the old one (pid {old_pid}) runs it"]
    state = _status(path)
    if state != "running":
        return [f"{qmp}: the new QEMU (pid {new_pid}) serves it but its guest is "
                f"{state or 'not answering'}: left as it is"]
    if not old_pid or old_start is None or journal.start_time(old_pid) != old_start:
        _drop(j)
        return [f"{qmp}: the new QEMU (pid {new_pid}) runs the guest"]
    moves = [(p, journal.aside(p)) for p in sorted(
        procfs.listening_unix_paths(new_pid) & procfs.listening_unix_paths(old_pid))]
    journal.write(j.parent, moves, old_pid)  # before the first rename, as a switch does
    for p, aside in moves:
        with contextlib.suppress(OSError):
            os.rename(p, aside)
    if not moves:  # nothing of the new QEMU's for its exit to unlink
        with contextlib.suppress(OSError):
            os.kill(old_pid, signal.SIGTERM)
        _drop(j)
    return [f"{qmp}: the new QEMU (pid {new_pid}) runs the guest: the old one (pid "
            f"{old_pid}, paused after the switch) goes"]


def _status(path: Path) -> str | None:
    async def query() -> str:
        end = Endpoint("recover", path)
        await end.connect(QMP_CONNECT_S)
        try:
            return str((await end.cmd("query-status")).get("status"))
        finally:
            await end.close()
    try:
        return asyncio.run(query())
    except (LivemigError, OSError, TimeoutError):
        return None


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + GONE_S
    while procfs.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _drop(j: Path) -> None:
    journal.clear(j.parent)
    with contextlib.suppress(OSError):
        j.parent.rmdir()
