"""``livemig upgrade --recover`` for an upgrade whose livemig died during the switch:
after the new QEMU was started and before the old one's quit.

The journal (:mod:`livemig.upgrade.journal`, phase ``switch``) names the new QEMU
(pid, start time), the VM's QMP path and, for the local-migration fallback, the old
QEMU's sockets moved aside before the new one started (it binds the same paths at
once, unlinking the old one's). What is found then decides:

- the new QEMU serves the QMP path and its guest runs: the switch happened and the
  old QEMU is paused (``postmigrate``) for good: it goes, as the quit makes it go,
  with the sockets both processes listen on moved aside while it exits (its exit
  unlinks its listening paths, which are the new QEMU's now); the journal records
  those renames first, and :func:`journal.recover` ends it and puts them back;
- it serves the path but its guest does not run: if the old QEMU (reached at its
  socket moved aside) runs the guest with no migration under way or done, the new one
  never got it: killed, as below; otherwise left as it is and said (killing it could
  lose a guest whose migration completes meanwhile), the journal kept;
- it lives but does not serve the path (cpr-transfer opens the new QEMU's monitors
  only once the old one has sent its CPR state: it never got the guest): killed;
  then, as when it is gone, the old QEMU keeps the guest and its sockets moved aside
  go back (a dead socket the new QEMU left at a path first removed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from livemig.engine.endpoint import Endpoint, socket_peer_pid
from livemig.errors import LivemigError
from livemig.upgrade import journal, procfs

GONE_S = 10.0  # a QEMU killed with SIGKILL is gone in well under a second
QMP_CONNECT_S = 5.0  # the new QEMU's monitor answers at once when it serves the path


def settle(j: Path) -> list[str]:
    """Settle a journal left during the switch; what was done, one line each. A
    journal of the quit (renames of the new QEMU's sockets) is left to
    :func:`journal.recover`."""
    data = journal.read(j)
    if not data or data.get("phase") != journal.SWITCH:
        return []
    new_pid, new_start = int(data.get("new_pid") or 0), data.get("new_start")
    old_pid = int(data.get("old_pid") or 0)
    qmp = str(data.get("qmp") or "")
    lines: list[str] = []
    if new_pid and new_start is not None and journal.start_time(new_pid) == new_start:
        if qmp and socket_peer_pid(Path(qmp)) == new_pid:
            state = _status(Path(qmp))
            if state == "running":
                return _end_old(j, data, new_pid, qmp)
            if not _old_keeps_guest(dict(journal.moved_from(j)).get(qmp)):
                # taking the guest (or stuck): killing it now could lose a guest whose
                # migration completes meanwhile; said, the journal kept
                return [f"{qmp}: the new QEMU (pid {new_pid}) serves it but its guest "
                        f"is {state or 'not answering'}: left as it is; run --recover "
                        "again once it runs"]
        _kill(new_pid)
        lines.append(f"{qmp}: killed the new QEMU (pid {new_pid}): it never got the "
                     f"guest; the old one (pid {old_pid}) runs it")
    elif new_pid:
        lines.append(f"{qmp}: the new QEMU (pid {new_pid}) is gone: the old one (pid "
                     f"{old_pid}) keeps the guest")
    # the old QEMU keeps the guest: its sockets moved aside before the new QEMU
    # started go back
    restored, left = journal.put_back_before_switch(journal.moved_from(j))
    lines += [f"put back {p}" for p in restored]
    if left:
        lines.append(f"{j}: some sockets could not be put back (their paths are taken "
                     "again): left as they are")
    else:
        _drop(j)
    return lines


def _end_old(j: Path, data: dict[str, object], new_pid: int, qmp: str) -> list[str]:
    """The switch happened: the old QEMU (paused for good) goes, with the sockets both
    listen on moved aside while it exits, as the quit does."""
    old_pid, old_start = int(str(data.get("old_pid") or 0)), data.get("old_start")
    if not old_pid or old_start is None or journal.start_time(old_pid) != old_start:
        _drop(j)
        return [f"{qmp}: the new QEMU (pid {new_pid}) runs the guest"]
    moves = [(p, journal.aside(p)) for p in sorted(
        procfs.listening_unix_paths(new_pid) & procfs.listening_unix_paths(old_pid))]
    journal.write(j.parent, moves, old_pid)  # before the first rename, as the quit does
    for p, aside in moves:
        with contextlib.suppress(OSError):
            os.rename(p, aside)  # over the old QEMU's own, if it was moved there
    if not moves:  # nothing of the new QEMU's for its exit to unlink
        with contextlib.suppress(OSError):
            os.kill(old_pid, signal.SIGTERM)
        _drop(j)
    return [f"{qmp}: the new QEMU (pid {new_pid}) runs the guest: the old one (pid "
            f"{old_pid}, paused after the switch) goes"]


def _old_keeps_guest(aside: str | None) -> bool:
    """Whether the old QEMU, reached at its socket moved aside, runs the guest with no
    migration under way or done (then the new QEMU never got it)."""
    if aside is None or not os.path.lexists(aside):
        return False
    got = _query(Path(aside), "query-status", "query-migrate")
    if got is None:
        return False
    state, mig = got
    return state.get("status") == "running" and mig.get("status", "none") in (
        "none", "failed", "cancelled")


def _status(path: Path) -> str | None:
    got = _query(path, "query-status")
    return None if got is None else str(got[0].get("status"))


def _query(path: Path, *commands: str) -> list[dict[str, Any]] | None:
    async def query() -> list[dict[str, Any]]:
        end = Endpoint("recover", path)
        await end.connect(QMP_CONNECT_S)
        try:
            return [dict(await end.cmd(c)) for c in commands]
        finally:
            await end.close()
    try:
        return asyncio.run(query())
    except (LivemigError, OSError, TimeoutError):
        return None


def _kill(pid: int) -> None:
    """SIGKILL, then wait until every thread has exited: the leader turns zombie while
    the other threads still exit, and the sockets close only with the last of them
    (a socket put back too early would find the path still served)."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + GONE_S
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _exited(pid: int) -> bool:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for t in tasks:
        try:
            state = (t / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            return False
    return True


def _drop(j: Path) -> None:
    journal.clear(j.parent)
    with contextlib.suppress(OSError):
        j.parent.rmdir()
