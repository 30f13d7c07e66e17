"""One end of a migration: a QEMU's QMP socket. ``qemu.qmp`` is wrapped here only.

The caller may give hooks it alone can answer: ``alive()`` (the lab owns the
process), ``pid`` (CPU accounting), ``ram_file`` (guest RAM in a shared file that
the lab can compare byte for byte). For a QEMU livemig did not start none of them
is needed; the pid is then read from the socket's peer credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

from livemig.errors import UsageError, VMError

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

# Every QMP command has a deadline: a monitor that does not answer is a VMError naming
# the command, never a wait without end. 30 s: a QEMU answers a query in
# milliseconds, a TCG guest at full load within a second; longer means its main loop
# is stuck (e.g. blocked on a dead migration link during stop-and-copy).
QMP_TIMEOUT_S = 30.0
# Commands that do real work while the caller waits: the RAM digest hashes all of
# guest RAM (about 1 GiB/s per core: 600 s covers 64 GiB on a slow host); block
# jobs and NBD nodes may wait on a network peer.
SLOW_QMP_S: dict[str, float] = {
    "x-query-ram-digest": 600.0,
    "block-job-cancel": 120.0, "block-job-complete": 120.0, "blockdev-del": 120.0,
    "blockdev-add": 120.0, "nbd-server-stop": 60.0, "human-monitor-command": 60.0,
}


def qmp_timeout(command: str) -> float:
    return SLOW_QMP_S.get(command, QMP_TIMEOUT_S)


class Client(QMPClient):
    """``QMPClient`` that formats a message for its debug log only when that log is
    on. qemu.qmp (0.0.6) logs every message in and out as ``str(msg)``, a
    ``json.dumps(indent=2)`` made before the logger decides to drop it: ~0.07 s of
    this process's CPU for ``query-qmp-schema``'s 236 KB reply on this host, which the
    encoding's context waits for before ``migrate``."""

    def _cb_outbound(self, msg: Any) -> Any:
        if self.logger.isEnabledFor(logging.DEBUG):
            return super()._cb_outbound(msg)
        return msg

    def _cb_inbound(self, msg: Any) -> Any:
        if self.logger.isEnabledFor(logging.DEBUG):
            return super()._cb_inbound(msg)
        return msg


class QmpEnd(Protocol):
    """What the engine needs from an end (a scripted fake implements it too)."""

    name: str

    async def cmd(self, command: str, **args: Any) -> Any: ...

    async def next_event(self, timeout: float) -> dict[str, Any] | None: ...

    async def has_command(self, command: str) -> bool: ...

    def alive(self) -> bool: ...

    @property
    def ram_file(self) -> Path | None: ...

    @property
    def pid(self) -> int | None: ...


class Endpoint:
    """A QMP connection to one QEMU, by socket path."""

    def __init__(self, name: str, socket_path: Path, *,
                 alive: Callable[[], bool] | None = None, pid: int | None = None,
                 ram_file: Path | None = None) -> None:
        self.name = name
        self.socket_path = Path(socket_path)
        self._alive = alive
        self._pid = pid
        self._ram_file = ram_file
        self.qmp: QMPClient | None = None
        self._commands: frozenset[str] | None = None

    @property
    def ram_file(self) -> Path | None:
        return self._ram_file

    @property
    def pid(self) -> int | None:
        return self._pid

    def alive(self) -> bool:
        if self._alive is not None:
            return self._alive()
        if self._pid is not None:
            return Path(f"/proc/{self._pid}").exists()
        return self.qmp is not None

    async def connect(self, timeout: float = 30.0) -> None:
        """Connect once the socket appears; a refused connection means "not yet"."""
        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():
            if self._alive is not None and not self._alive():
                raise VMError(f"{self.name}: QEMU exited before its QMP socket appeared")
            if time.monotonic() > deadline:
                raise VMError(f"{self.name}: QMP socket {self.socket_path} did not appear "
                              f"within {timeout:.0f}s")
            await asyncio.sleep(0.02)
        while True:
            client = Client(f"livemig-{self.name}")
            try:
                await asyncio.wait_for(client.connect(str(self.socket_path)),
                                       max(1.0, deadline - time.monotonic()))
                break
            except (QMPError, OSError, TimeoutError) as e:
                refused = isinstance(e, ConnectionRefusedError) or "refused" in str(e)
                if not refused or time.monotonic() > deadline or not self.alive_or_unknown():
                    raise VMError(f"{self.name}: cannot connect to QMP at "
                                  f"{self.socket_path}: {e}") from e
                await asyncio.sleep(0.05)
        self.qmp = client

    def alive_or_unknown(self) -> bool:
        return self._alive() if self._alive is not None else True

    async def cmd(self, command: str, **args: Any) -> Any:
        if self.qmp is None:
            raise VMError(f"{self.name}: not connected")
        limit = qmp_timeout(command)
        try:
            return await asyncio.wait_for(self.qmp.execute(command, args or None), limit)
        except TimeoutError:
            raise VMError(f"{self.name}: {command}: no answer from QEMU within "
                          f"{limit:.0f}s") from None
        except QMPError as e:
            raise VMError(f"{self.name}: {command}: {e}") from e
        except (OSError, EOFError) as e:
            raise VMError(f"{self.name}: {command}: QMP connection lost: {e}") from e

    async def oob(self, command: str, **args: Any) -> Any:
        """An out-of-band command (``exec-oob``: QEMU runs it in the monitor's own
        thread, without the main lock; ``yank`` is one). qemu.qmp enables OOB when
        QEMU's greeting offers it."""
        if self.qmp is None:
            raise VMError(f"{self.name}: not connected")
        try:
            return await asyncio.wait_for(self.qmp.execute(command, args or None, oob=True),
                                          QMP_TIMEOUT_S)
        except TimeoutError:
            raise VMError(f"{self.name}: {command} (oob): no answer from QEMU within "
                          f"{QMP_TIMEOUT_S:.0f}s") from None
        except (QMPError, OSError, EOFError) as e:
            raise VMError(f"{self.name}: {command} (oob): {e}") from e

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next QMP event, or None after ``timeout`` seconds."""
        if self.qmp is None:
            await asyncio.sleep(timeout)
            return None
        try:
            ev = await asyncio.wait_for(self.qmp.events.get(), max(timeout, 0.0))
        except TimeoutError:
            return None
        return dict(ev)

    async def has_command(self, command: str) -> bool:
        if self._commands is None:
            reply = await self.cmd("query-commands")
            self._commands = frozenset(c["name"] for c in reply)
        return command in self._commands

    async def close(self) -> None:
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.qmp.disconnect(), 2.0)
            self.qmp = None


def socket_peer_pid(path: Path) -> int | None:
    """The pid of the process listening on a unix socket (SO_PEERCRED), or None.

    QEMU's monitor serves one client at a time; this connection is closed at once, so
    QEMU takes the next one."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(path))
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                 struct.calcsize("3i"))
            pid, _uid, _gid = struct.unpack("3i", creds)
            return pid if pid > 0 else None
    except OSError:
        return None


def process_argv(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def require_socket(path: Path, what: str) -> Path:
    """A one-line usage error unless ``path`` is a unix socket."""
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise UsageError(f"{what} {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"{what} {path}: not a unix socket")
    return path
