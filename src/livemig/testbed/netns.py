"""Running commands and opening sockets inside network namespaces."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from livemig.errors import SetupError

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def run(*argv: str, ns: str | None = None, check: bool = True) -> str:
    """Run a command (inside ``ns`` if given); one-line error on failure."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise SetupError(f"{cmd[0]} not found: install iproute2 (make setup)") from e
    if check and p.returncode != 0:
        err = (p.stderr or p.stdout).strip().splitlines()
        raise SetupError(f"{' '.join(cmd)}: {err[-1] if err else f'exit {p.returncode}'}")
    return p.stdout


def exists(ns: str) -> bool:
    return (NETNS_DIR / ns).exists()


def exec_prefix(ns: str) -> list[str]:
    return ["ip", "netns", "exec", ns]


@contextlib.contextmanager
def _entered(ns: str) -> Iterator[None]:
    """Move the calling *thread* into ``ns`` (network namespaces are per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise SetupError(f"cannot enter namespace {ns}: "
                             f"{os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            libc.setns(home, _CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(home)


def call_in(ns: str, fn: Callable[[], T]) -> T:
    """Call ``fn`` in a thread that lives in ``ns``; sockets it creates stay there."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            with _entered(ns):
                box["value"] = fn()
        except BaseException as e:  # handed back to the caller
            box["error"] = e

    t = threading.Thread(target=body, name=f"netns-{ns}")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
