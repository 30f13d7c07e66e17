"""What a lab run leaves on the host, recorded so a later command can clean up.

Each run writes ``/run/livemig/RUN/state.json``: the livemig process that owns it
(pid and start time, so a reused pid is not mistaken for it), its QEMU processes
and the files it created (guest RAM in ``/dev/shm``, disk images). QEMUs run on
when livemig dies (crash safety), so the next ``livemig`` command or ``livemig
testbed down`` calls :func:`reap`, which removes what runs of dead owners left —
never anything of a live run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from livemig import paths, private

log = logging.getLogger(__name__)
STATE = "state.json"


def _start_time(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def _owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"owner_pid": pid, "owner_start": _start_time(pid)}


class RunState:
    """The state file of one run, rewritten whenever something is added."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATE
        self.data: dict[str, Any] = {**_owner(), "qemu": {}, "files": []}

    def add_qemu(self, name: str, pid: int | None) -> None:
        if pid is not None:
            self.data["qemu"][name] = {"pid": pid, "start": _start_time(pid)}
            self._write()

    def add_file(self, path: Path) -> None:
        self.data["files"].append(str(path))
        self._write()

    def _write(self) -> None:
        private.make_dir(self.path.parent)
        private.write_text(self.path, json.dumps(self.data))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def owner_alive(data: dict[str, Any]) -> bool:
    pid = data.get("owner_pid")
    if not isinstance(pid, int):
        return False
    return _start_time(pid) == data.get("owner_start") is not None


def reap(root: Path | None = None) -> list[str]:
    """Remove what runs whose livemig died left behind; return what was removed."""
    root = root or paths.run_root()
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for state in root.glob(f"*/{STATE}"):
        try:
            data = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        if owner_alive(data):
            continue
        killed = []
        for name, q in data.get("qemu", {}).items():
            pid = q.get("pid")
            if isinstance(pid, int) and _start_time(pid) == q.get("start") is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append((name, pid))
        for _, pid in killed:
            deadline = time.monotonic() + 5
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        for f in data.get("files", []):
            with contextlib.suppress(FileNotFoundError):
                Path(f).unlink()
                removed.append(f)
        removed += [f"QEMU {name} (pid {pid}) of run {state.parent.name}"
                    for name, pid in killed]
        shutil.rmtree(state.parent, ignore_errors=True)
        removed.append(f"run directory {state.parent}")
        log.info("reaped run %s", state.parent.name)
    return removed
