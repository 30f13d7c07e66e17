"""``--dst-start``: start the destination QEMU from the source's own command line.

On this host only (the source's argv is read from /proc through the QMP socket's peer
pid). The copy gets ``-incoming defer -S`` and livemig's own QMP socket; everything
that names a host resource the source holds is moved into the run directory: socket
and file chardev paths, ``unix:``/``file:`` monitor and serial backends, the pid
file; ``-daemonize`` is dropped. A source whose RAM is a shared file is refused
(two QEMUs would write the same memory). livemig started this QEMU, so it stops it
when the migration does not complete; after a completed one it is the VM, in its own
session, independent of livemig.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from livemig import private
from livemig.errors import UsageError, VMError

DROP_WITH_ARG = {"-incoming", "-pidfile"}
DROP_ALONE = {"-S", "-daemonize"}
_PATH_KEYS = re.compile(r"((?:^|,)(?:path|logfile)=)([^,]+)")
_BACKEND = re.compile(r"^(unix:|file:)([^,]+)(.*)$")


def destination_argv(src_argv: list[str], run_dir: Path) -> tuple[list[str], Path]:
    """The destination's command line and its QMP socket path."""
    if not src_argv:
        raise UsageError("--dst-start: cannot read the source QEMU's command line")
    out: list[str] = [src_argv[0]]
    n = 0

    def moved(name: str) -> str:
        nonlocal n
        n += 1
        return str(run_dir / f"dst-{name}-{n}")

    args = src_argv[1:]
    i = 0
    while i < len(args):
        a = args[i]
        if a in DROP_ALONE:
            i += 1
            continue
        if a in DROP_WITH_ARG:
            i += 2
            continue
        out.append(a)
        if i + 1 < len(args) and a.startswith("-"):
            v = args[i + 1]
            if "memory-backend-file" in v and re.search(r"(^|,)share=(on|yes|true)", v):
                raise UsageError("--dst-start: the source's RAM is a shared "
                                 "memory-backend-file; a second QEMU on it would share "
                                 "the guest's memory (start the destination yourself)")
            if a == "-chardev":
                cid = re.search(r"(?:^|,)id=([^,]+)", v)
                name = cid.group(1) if cid else "chardev"
                v = _PATH_KEYS.sub(_renamer(name, moved), v)
            elif a in ("-qmp", "-qmp-pretty", "-monitor", "-serial", "-parallel",
                       "-debugcon"):
                m = _BACKEND.match(v)
                if m:
                    v = m.group(1) + moved(a.lstrip("-")) + m.group(3)
            out.append(v)
            i += 2
            continue
        i += 1
    qmp = run_dir / "dst.qmp"
    out += ["-qmp", f"unix:{qmp},server=on,wait=off", "-incoming", "defer", "-S"]
    return out, qmp


def _renamer(name: str, moved: Callable[[str], str]) -> Callable[[re.Match[str]], str]:
    def sub(m: re.Match[str]) -> str:
        return m.group(1) + moved(name)
    return sub


def start(argv: list[str], run_dir: Path, timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """Start the destination in its own session; wait for its QMP socket."""
    private.make_dir(run_dir)
    qmp = Path(argv[argv.index("-qmp") + 1].split(",")[0].removeprefix("unix:"))
    with os.fdopen(private.open_file(run_dir / "dst.log"), "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    umask=private.CHILD_UMASK)
        except OSError as e:
            raise VMError(f"--dst-start: cannot run {argv[0]}: {e.strerror}") from e
    deadline = time.monotonic() + timeout
    while not qmp.exists():
        if proc.poll() is not None:
            tail = (run_dir / "dst.log").read_text(errors="replace").strip()[-300:]
            raise VMError(f"--dst-start: the destination QEMU exited: {tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise VMError("--dst-start: the destination's QMP socket did not appear")
        time.sleep(0.05)
    return proc
