"""The state of a QEMU's migration connections as the kernel sees them.

While QEMU sends the final state (stop-and-copy) its main loop holds the big lock:
QMP answers nothing, so ``query-migrate`` cannot tell a slow final send from a dead
link. The kernel can: ``bytes_acked`` of the source's TCP connections to the
migration port grows while the destination receives, and stops when the link is
dead. Read with ``ss`` inside the source QEMU's network namespace (``nsenter``:
the lab's testbed runs it in its own; QMP is a unix socket, so that QEMU is on
this host). Summed over the connections (multifd opens several to one port).

Acks that stop are not enough to call a link dead: a destination that reads slowly
(its CPU busy loading) closes its receive window, and the acked count stands still
while its kernel still answers every probe. So :class:`LinkState` also carries the
bytes still unacknowledged (``Send-Q``) and how long ago the last ACK came (``ss``'s
``lastack``): a link is dead when bytes wait and no ACK, not even a zero-window one,
came for the timeout. Connections in every connected state are counted: after the
source completed, QEMU has closed its end and the last bytes drain in ``FIN-WAIT-1``.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

SS_TIMEOUT_S = 5.0
ACKED = re.compile(r"\bbytes_acked:(\d+)")
LAST_ACK = re.compile(r"\blastack:(\d+)")


@dataclass(frozen=True)
class LinkState:
    acked: int  # bytes the peer acknowledged, over the connections
    pending: int  # bytes sent or queued and not yet acknowledged (Send-Q), summed
    # seconds since the freshest ACK on a connection with pending bytes; None when
    # no connection has any (or the kernel does not say)
    last_ack_s: float | None


def parse_state(ss_output: str) -> LinkState | None:
    """The connections of ``ss -tinH`` output (header line, then the info line); None
    when there is none."""
    acked = pending = 0
    freshest: float | None = None
    found = False
    send_q = 0
    for line in ss_output.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # a connection: [State] Recv-Q Send-Q Local Peer
            tok = line.split()
            addr = next((i for i, t in enumerate(tok) if ":" in t), None)
            send_q = int(tok[addr - 1]) if addr and tok[addr - 1].isdigit() else 0
            pending += send_q
            continue
        m = ACKED.search(line)
        if m is None:
            continue
        found = True
        acked += int(m.group(1))
        la = LAST_ACK.search(line)
        if send_q and la is not None:
            t = int(la.group(1)) / 1000.0
            freshest = t if freshest is None else min(freshest, t)
    return LinkState(acked, pending, freshest) if found else None


def in_netns(pid: int, *argv: str, timeout: float = SS_TIMEOUT_S) -> str | None:
    """The output of ``argv`` run in ``pid``'s network namespace (``nsenter``); None
    when it cannot run or fails (no such process, no tool, no permission)."""
    try:
        out = subprocess.run(["nsenter", "-t", str(pid), "-n", *argv], capture_output=True,
                             text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def link_state(pid: int, port: int) -> LinkState | None:
    """The state of ``pid``'s network namespace's connections to ``port``; None
    when that cannot be read (no such process, no tool, no connection)."""
    out = in_netns(pid, "ss", "-tinH", "state", "connected", f"( dport = :{port} )")
    return parse_state(out) if out is not None else None


def tcp_port(uri: str) -> int | None:
    """The port of a ``tcp:HOST:PORT`` migration URI (None for ``unix:`` and others)."""
    if not uri.startswith("tcp:"):
        return None
    try:
        return int(uri.rsplit(":", 1)[1].split(",", 1)[0])
    except ValueError:
        return None
