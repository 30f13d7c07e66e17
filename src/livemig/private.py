"""Files a local user cannot take over: livemig's run directories, state files, logs
and the guest RAM files of the lab.

livemig runs as root and puts sockets, logs, disk images and guest RAM where other
local users can look (``/run/livemig``, ``/dev/shm``). Whoever can read a RAM file
reads the guest's memory; whoever created it first (``/dev/shm`` is world-writable)
owns the guest's memory; whoever can write a state file steers what the next
livemig command kills or deletes. So:

- a run directory is ``0700``, owned by livemig's user, and not a symbolic link
  (an existing one owned by someone else is refused, never reused);
- state files and logs are created ``0600`` and never through a symbolic link;
- a RAM file is created here, exclusively (``O_CREAT|O_EXCL``, ``0600``), before
  QEMU opens it: QEMU then opens the file livemig made, never one a user planted.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from livemig.errors import SetupError

DIR_MODE = 0o700
FILE_MODE = 0o600
CHILD_UMASK = 0o077  # what QEMU creates itself (console, trace, sockets): owner only


def make_dir(path: Path) -> Path:
    """Create ``path`` (parents as needed, with the default mode) as a private
    directory, or make an existing one private if it is ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"{path} exists and is not a directory (a symbolic link?): "
                         "refusing to use it")
    if st.st_uid != os.geteuid():
        raise SetupError(f"{path} belongs to uid {st.st_uid}, not to livemig's user: "
                         "refusing to use it")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_file(path: Path, append: bool = False) -> int:
    """A file descriptor for writing ``path``, created ``0600`` (an existing file
    is truncated, or appended to, and made ``0600``); never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_TRUNC
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a private temporary file renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with os.fdopen(open_file(tmp), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def create_exclusive(path: Path) -> Path:
    """Create the empty file ``path``, ``0600``; refuse if anything is there.

    A leftover of livemig's own (a regular file owned by livemig's user, e.g. a run
    id used again after a crash) is removed first; anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise SetupError(f"{path} exists and is not livemig's (uid {st.st_uid}): "
                             "refusing to use it as guest RAM")
        path.unlink()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE)
    except FileExistsError:
        raise SetupError(f"{path} appeared while livemig was creating it: refusing to "
                         "use it as guest RAM") from None
    os.close(fd)
    return path
