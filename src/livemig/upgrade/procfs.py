"""What livemig reads from a running QEMU process through /proc, and the one thing
it takes from it: a duplicate of its open tap (``pidfd_getfd``, Linux >= 5.6; root
or ptrace rights over the process)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

from livemig.errors import VMError

_SYS_PIDFD_GETFD = 438  # the same number on every architecture
_O_CLOEXEC = 0o2000000
_SO_ACCEPTCON = 0x10000  # /proc/net/unix flags: a listening socket


def tap_fds(pid: int) -> dict[str, tuple[int, bool]]:
    """Tap interface name → (fd number, close-on-exec) of the process's open taps."""
    out: dict[str, tuple[int, bool]] = {}
    base = Path(f"/proc/{pid}/fdinfo")
    try:
        entries = list(base.iterdir())
    except OSError as err:
        raise VMError(f"cannot read {base}: {err.strerror}") from err
    for entry in entries:
        try:
            text = entry.read_text()
        except OSError:
            continue
        iff = flags = None
        for line in text.splitlines():
            if line.startswith("iff:"):
                iff = line.split(":", 1)[1].strip()
            elif line.startswith("flags:"):
                flags = int(line.split(":", 1)[1].strip(), 8)
        if iff:
            out[iff] = (int(entry.name), bool(flags is not None and flags & _O_CLOEXEC))
    return out


def grab_fd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of the process ``pid``'s fd ``fd`` (the same open
    file description); inheritable so that a child can be given it."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise VMError(f"pidfd_open({pid}): {e.strerror}") from e
    try:
        new = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
        if new < 0:
            err = ctypes.get_errno()
            raise VMError(f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
    finally:
        os.close(pidfd)
    os.set_inheritable(new, True)
    return new


def listening_unix_paths(pid: int) -> set[str]:
    """Filesystem paths of the unix sockets the process listens on."""
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    paths: set[str] = set()
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        return paths
    for line in lines:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and int(f[3], 16) & _SO_ACCEPTCON \
                and f[7].startswith("/"):
            paths.add(f[7])
    return paths


def netns_prefix(pid: int) -> list[str]:
    """Run a command in the network namespace of ``pid`` (empty if it is ours)."""
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        ours = os.stat("/proc/self/ns/net").st_ino
    except OSError as e:
        raise VMError(f"cannot read the network namespace of pid {pid}: {e.strerror}") from e
    return [] if theirs == ours else ["nsenter", f"--net=/proc/{pid}/ns/net"]


def exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
