"""Ways to read guest-physical memory from outside a QEMU, for the peek sampler.

- :class:`ProcMemReader`: the QEMU process's own mapping of guest RAM, read through
  ``/proc/PID/mem`` at the host address HMP ``gpa2hva`` gives for each RAM range: two
  monitor calls per range and none per read, so QEMU's main loop (and the BQL) does
  nothing while the clusters are read. The QEMU must run on this host and livemig may
  trace it (root, or its user where Yama allows); a read it cannot make goes to
  ``pmemsave``.
- :class:`PmemsaveReader`: QMP ``pmemsave`` into a private directory this process
  made (0700, handed to QEMU's user if QEMU runs as another one); the QEMU must run on
  this host. One monitor call and one small file per cluster.
- :class:`XpReader`: HMP ``xp`` (``/Nxg``: 8-byte words in hex), for a QEMU whose
  files this host cannot read; about ten times the bytes over the monitor.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from livemig.errors import VMError
from livemig.sampling.layout import RamRange

Command = Callable[..., Awaitable[Any]]
Read = Callable[[int, int], Awaitable[bytes]]  # (gpa, size) -> bytes
_WORD = re.compile(r"0x([0-9a-f]{1,16})")
_HVA = re.compile(r"^Host virtual address for 0x[0-9a-f]+ \(.*\) is (0x[0-9a-f]+)\s*$")


def hmp_over(cmd: Command) -> Callable[[str], Awaitable[str]]:
    """An HMP command line run through QMP's ``human-monitor-command``."""
    async def hmp(line: str) -> str:
        return str(await cmd("human-monitor-command", **{"command-line": line}))
    return hmp


def qemu_is_local(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


def parse_gpa2hva(text: str) -> int | None:
    """The host address in HMP ``gpa2hva``'s answer; None for its errors (no memory
    there, not RAM)."""
    m = _HVA.match(text.strip())
    return int(m.group(1), 16) if m else None


class ProcMemReader:
    """Reads guest RAM where the QEMU process maps it, through ``/proc/PID/mem``.

    :meth:`prepare` asks HMP ``gpa2hva`` for the host address of each RAM range's
    first and last byte and keeps the ranges QEMU maps contiguously (a flat range is
    part of one RAM block, so all of them, but it is checked rather than assumed).
    A read inside a kept range is one ``pread``; any other read, or one the kernel
    refuses, goes to ``fallback`` (counted in :attr:`fallbacks`). Reading another
    process's memory neither stops nor changes it."""

    def __init__(self, hmp: Callable[[str], Awaitable[str]], pid: int,
                 fallback: Read) -> None:
        # ptrace access is checked here: a PermissionError tells the caller to use
        # another reader
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        self.hmp = hmp
        self.fallback = fallback
        self.spans: list[tuple[int, int, int]] = []  # (gpa, size, hva)
        self.fallbacks = 0

    async def prepare(self, ranges: list[RamRange]) -> None:
        spans = []
        for r in ranges:
            first = parse_gpa2hva(await self.hmp(f"gpa2hva {r.gpa:#x}"))
            last = parse_gpa2hva(await self.hmp(f"gpa2hva {r.gpa + r.size - 1:#x}"))
            if first is not None and last == first + r.size - 1:
                spans.append((r.gpa, r.size, first))
        self.spans = spans

    async def __call__(self, gpa: int, size: int) -> bytes:
        for start, length, hva in self.spans:
            if start <= gpa and gpa + size <= start + length:
                try:
                    data = os.pread(self.fd, size, hva + gpa - start)
                except OSError:
                    break
                if len(data) == size:
                    return data
                break
        self.fallbacks += 1
        return await self.fallback(gpa, size)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class PmemsaveReader:
    """Reads through ``pmemsave``: a QEMU on this host writes the range to a file in
    a directory only this process (and QEMU's user) can enter; read, then removed."""

    def __init__(self, cmd: Command, pid: int | None, base: Path | None = None) -> None:
        self.cmd = cmd
        uid = _owner(pid)
        other_user = uid is not None and uid != os.geteuid()
        if other_user:
            # QEMU runs as another user (libvirt's qemu user, say): it must be able to
            # reach the directory, so not below livemig's private 0700 run root
            base = None
        if base is not None:
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="livemig-sample-",
                                         dir=str(base) if base else None))
        os.chmod(self.dir, 0o700)
        if other_user:
            assert uid is not None
            os.chown(self.dir, uid, -1)  # QEMU writes the files, we read them as root
        self._n = itertools.count()

    async def __call__(self, gpa: int, size: int) -> bytes:
        path = self.dir / f"r{next(self._n)}"
        await self.cmd("pmemsave", val=gpa, size=size, filename=str(path))
        try:
            data = path.read_bytes()
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if len(data) != size:
            raise VMError(f"pmemsave of {size} bytes at {gpa:#x} gave {len(data)}")
        return data

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class XpReader:
    """Reads through HMP ``xp /Nxg ADDR`` (works over any monitor connection)."""

    def __init__(self, hmp: Callable[[str], Awaitable[str]]) -> None:
        self.hmp = hmp

    async def __call__(self, gpa: int, size: int) -> bytes:
        words = size // 8
        text = await self.hmp(f"xp /{words}xg {gpa:#x}")
        vals = [int(m.group(1), 16) for line in text.splitlines()
                for m in _WORD.finditer(line.partition(":")[2])]
        if len(vals) != words:
            raise VMError(f"xp at {gpa:#x}: {len(vals)} words of {words}")
        return b"".join(v.to_bytes(8, "little") for v in vals)

    def close(self) -> None:
        return None


def status_field(pid: int, key: str) -> list[str] | None:
    """The values of one line of ``/proc/PID/status`` (``Uid``, ``Tgid``...); None
    when the process or the line is not there."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, values = line.partition(":")
            if name == key:
                return values.split()
    except OSError:
        return None
    return None


def _owner(pid: int | None) -> int | None:
    uid = status_field(pid, "Uid") if pid is not None else None
    return int(uid[1]) if uid else None  # effective uid
