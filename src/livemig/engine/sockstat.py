"""Bytes the peer acknowledged on a QEMU's migration connections (the kernel's view).

While QEMU sends the final state (stop-and-copy) its main loop holds the big lock:
QMP answers nothing, so ``query-migrate`` cannot tell a slow final send from a dead
link. The kernel can: ``bytes_acked`` of the source's TCP connections to the
migration port grows while the destination receives, and stops when the link is
dead. Read with ``ss`` inside the source QEMU's network namespace (``nsenter``:
the lab's testbed runs it in its own; QMP is a unix socket, so that QEMU is on
this host). Summed over the connections (multifd opens several to one port).
"""

from __future__ import annotations

import re
import subprocess

SS_TIMEOUT_S = 5.0
ACKED = re.compile(r"\bbytes_acked:(\d+)")


def parse_acked(ss_output: str) -> int | None:
    """The sum of ``bytes_acked`` in ``ss -ti`` output; None when no connection."""
    found = [int(m) for m in ACKED.findall(ss_output)]
    return sum(found) if found else None


def acked_bytes(pid: int, port: int) -> int | None:
    """Acked bytes of ``pid``'s network namespace's connections to ``port``; None
    when that cannot be read (no such process, no tool, no connection)."""
    try:
        out = subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "ss", "-tinH", "state", "established",
             f"( dport = :{port} )"], capture_output=True, text=True, timeout=SS_TIMEOUT_S,
            check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_acked(out.stdout) if out.returncode == 0 else None


def tcp_port(uri: str) -> int | None:
    """The port of a ``tcp:HOST:PORT`` migration URI (None for ``unix:`` and others)."""
    if not uri.startswith("tcp:"):
        return None
    try:
        return int(uri.rsplit(":", 1)[1].split(",", 1)[0])
    except ValueError:
        return None
