"""The rename journal: sockets moved aside while the old QEMU quits, put back after.

When the old QEMU quits it unlinks the unix sockets it listened on (QMP, chardevs);
the new QEMU listens at the same paths, so those are renamed aside first
(``PATH.livemig-upgrade``) and back once the old process is gone. A livemig killed
in between (kill -9, a crash, the host's OOM killer) would leave the VM's sockets
at the aside names: the journal, written (0600, atomically) before the first
rename and removed after the last one is undone, lets ``livemig upgrade --recover``
(or the next ``livemig upgrade`` of that VM, whose error says so) put them back.

The same file is first written, without renames, as soon as the new QEMU is
started (its pid and start time, the VM's QMP path): a livemig killed during the
switch leaves either a new QEMU that never got the guest, or an old one paused for
good after handing it over; ``--recover`` settles those (:mod:`livemig.upgrade.recover`).

With renames, the journal is written once the new QEMU runs the guest and the old one
is about to be told to quit; it records the old QEMU (pid and start time). ``--recover``
finishes what was started: if that same old process is still there (livemig died
before it told it to quit) it is terminated first (SIGTERM: QEMU exits cleanly; its
guest state is stale, the guest runs in the new process), while the sockets are
still aside so its exit unlinks nothing of the new QEMU's; then the sockets go back.
A rename is undone only when the aside name still exists and nothing took the
original path since: the user's own file there wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

from livemig import paths, private

JOURNAL = "renames.json"
SUFFIX = ".livemig-upgrade"


SWITCH = "switch"  # the phase of a journal written during the switch


def aside(path: str) -> str:
    return f"{path}{SUFFIX}"


def _served(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def put_back_before_switch(moves: list[tuple[str, str]]) -> tuple[list[str], bool]:
    """Undo renames made before the new QEMU started (the old QEMU keeps the guest):
    a socket the new QEMU left at the original path (dead, nobody accepts on it)
    goes first; anything else there is never overwritten. (paths restored, whether
    something was left)."""
    return _rename_back(moves, dead_sockets_go=True)


def _rename_back(moves: list[tuple[str, str]],
                 dead_sockets_go: bool) -> tuple[list[str], bool]:
    """Rename each moved path back to its original; a path taken again at the
    original is never overwritten, except (``dead_sockets_go``) a socket nobody
    accepts on. (paths restored, whether something was left)."""
    restored, left = [], False
    for original, moved in moves:
        if not os.path.lexists(moved):
            continue
        if os.path.lexists(original):
            if dead_sockets_go and stat.S_ISSOCK(os.lstat(original).st_mode) \
                    and not _served(original):
                with contextlib.suppress(OSError):
                    os.unlink(original)
            else:
                left = True
                continue
        try:
            os.rename(moved, original)
            restored.append(original)
        except OSError:
            left = True
    return restored, left


OLD_EXIT_S = 10.0  # a QEMU told SIGTERM exits in well under a second


def start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22): a reused pid differs.
    None when it is gone (or a zombie: it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] == "Z" else fields[19]


def write(work: Path, moves: list[tuple[str, str]], old_pid: int | None = None,
          new_pid: int | None = None, qmp: str | None = None, phase: str = "quit"
          ) -> Path:
    """Record the renames about to be made (original, aside) in ``work``, and the old
    QEMU that is about to quit. Without renames (``moves`` empty): the switch is under
    way, the new QEMU ``new_pid`` started for the VM at ``qmp`` (see
    :mod:`livemig.upgrade.recover`)."""
    private.make_dir(work)
    path = work / JOURNAL
    data = {"pid": os.getpid(), "moves": moves, "old_pid": old_pid,
            "old_start": start_time(old_pid) if old_pid else None,
            "new_pid": new_pid, "new_start": start_time(new_pid) if new_pid else None,
            "qmp": qmp, "phase": phase}
    private.write_text(path, json.dumps(data))  # atomic
    return path


def clear(work: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (work / JOURNAL).unlink()


def pending() -> list[Path]:
    """Journals of upgrades whose livemig died before putting the sockets back."""
    root = paths.run_root()
    found = []
    for j in sorted(root.glob(f"upgrade-*/{JOURNAL}")):
        with contextlib.suppress(OSError, ValueError):
            pid = int(json.loads(j.read_text()).get("pid", 0))
            if pid and Path(f"/proc/{pid}").exists() and pid != os.getpid():
                continue  # that livemig still runs: its renames are its own business
            found.append(j)
    return found


def read(journal: Path) -> dict[str, Any]:
    """The journal's record ({} when unreadable or gone)."""
    try:
        data = json.loads(journal.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def moved_from(journal: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(journal.read_text())
        return [(str(a), str(b)) for a, b in data.get("moves", [])]
    except (OSError, ValueError, TypeError):
        return []


def _end_old(journal: Path) -> None:
    """The old QEMU the journal names, if that very process still runs, goes."""
    try:
        data = json.loads(journal.read_text())
        pid, start = int(data.get("old_pid") or 0), data.get("old_start")
    except (OSError, ValueError, TypeError):
        return
    if not pid or start is None or start_time(pid) != start:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + OLD_EXIT_S
    while start_time(pid) == start and time.monotonic() < deadline:
        time.sleep(0.05)


def recover(journal: Path) -> list[str]:
    """Put back what ``journal`` says was moved aside; returns the paths restored.
    The journal goes once nothing of it is left to put back. A journal without
    renames (the switch was under way) ends no process here:
    :func:`livemig.upgrade.recover.settle` decides those first."""
    moves = moved_from(journal)
    if not moves or read(journal).get("phase") == SWITCH:
        return []
    _end_old(journal)
    restored, left = _rename_back(moves, dead_sockets_go=False)
    if not left:
        with contextlib.suppress(FileNotFoundError):
            journal.unlink()
        with contextlib.suppress(OSError):
            journal.parent.rmdir()
    return restored


def mentions(path: Path) -> Path | None:
    """The pending journal that moved ``path`` aside, if any."""
    target = str(path)
    for j in pending():
        if any(original == target and os.path.lexists(moved)
               for original, moved in moved_from(j)):
            return j
    return None
