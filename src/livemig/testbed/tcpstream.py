"""A TCP stream from the client to the guest agent's sink, for the whole migration.

The guest's agent reads and discards everything sent to its TCP port 7778
(``guest/agent/sink.c``) and counts the bytes. The client (a real Linux TCP stack in
its namespace) writes as fast as the connection takes, and a sampler reads the
socket's ``TCP_INFO`` every 10 ms: ``tcpi_bytes_acked`` is what the guest's stack
acknowledged, so throughput is payload the guest received (one direction, unlike
the UDP echo stream), and the longest interval in which nothing new was acked is
TCP's view of the network pause. The connection lives in the guest's kernel, so it
moves with the migration: a reset or an error is recorded, not retried.

A stall includes TCP's own recovery: while the guest is paused the client's
retransmission timer backs off (200 ms, 400 ms, 800 ms, ...), so the stall ends at
the first retransmission after the guest runs again, not when it resumes.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from livemig.metrics import Gap
from livemig.testbed import netns
from livemig.testbed.topology import GUEST_IP, HOSTS

SINK_PORT = 7778  # the agent's TCP sink (guest/agent/agent.h SINK_PORT)
SAMPLE_S = 0.01
CHUNK = 256 << 10
# struct tcp_info (linux/tcp.h): offsets stable since Linux 4.1
_TI_TOTAL_RETRANS = 100  # u32
_TI_BYTES_ACKED = 120  # u64
_TI_LEN = 128


@dataclass
class TcpSamples:
    """(host time, cumulative bytes acked) every ``SAMPLE_S``."""

    points: list[tuple[float, int]] = field(default_factory=list)

    def acked_at(self, t: float) -> float | None:
        """Bytes acked at time ``t``, linear between samples (None: outside them)."""
        pts = self.points
        if not pts or t < pts[0][0] or t > pts[-1][0]:
            return None
        i = bisect.bisect_left(pts, (t, -1))
        if pts[i][0] == t or i == 0:
            return float(pts[i][1])
        (t0, b0), (t1, b1) = pts[i - 1], pts[i]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0)

    def rate(self, start: float | None, end: float | None) -> float | None:
        """Bytes/s acked in [start, end], clipped to the sampled span (None if the
        clipped span is empty or under 0.2 s)."""
        if start is None or end is None or not self.points:
            return None
        start, end = max(start, self.points[0][0]), min(end, self.points[-1][0])
        if end - start < 0.2:
            return None
        a, b = self.acked_at(start), self.acked_at(end)
        assert a is not None and b is not None
        return (b - a) / (end - start)

    def progress_times(self) -> list[float]:
        """Sample times at which the acked count had grown since the sample before."""
        return [t for (_, b0), (t, b) in itertools.pairwise(self.points) if b > b0]


def longest_stall(progress: Sequence[float], start: float, end: float) -> Gap | None:
    """Longest interval without progress that overlaps [start, end].

    ``progress`` are the (sorted) times the stream moved. A stall that began before
    ``start`` counts from its real beginning (the last progress before ``start``); a
    stall still going at ``end`` counts up to ``end`` (the stream never recovered
    while observed). None without any progress at or before ``end``.
    """
    i = bisect.bisect_right(progress, start)
    edges = ([progress[i - 1]] if i else []) + [t for t in progress[i:] if t <= end]
    if not edges:
        return None
    edges.append(end)
    best: Gap | None = None
    for a, b in itertools.pairwise(edges):
        if best is None or b - a > best.seconds:
            best = Gap(b - a, a, b)
    return best


def stall_without_hold(gap: Gap | None, hold: tuple[float, float] | None) -> float | None:
    """A stall's seconds minus the time livemig held the guest for the RAM check when
    the stall spans the start of that hold (a real migration has no hold)."""
    if gap is None:
        return None
    if hold is not None and gap.start <= hold[0] <= gap.end:
        return max(gap.seconds - (hold[1] - hold[0]), 0.0)
    return gap.seconds


def tcp_info(sock: socket.socket) -> tuple[int, int]:
    """(payload bytes acked, total retransmissions) of a connected TCP socket.

    The kernel's ``tcpi_bytes_acked`` counts the SYN (and, once acked, the FIN) as
    one byte each: the SYN is taken off here."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TI_LEN)
    (retrans,) = struct.unpack_from("I", raw, _TI_TOTAL_RETRANS)
    (acked,) = struct.unpack_from("Q", raw, _TI_BYTES_ACKED)
    return max(acked - 1, 0), retrans


class TcpStream:
    """Sends to the guest's sink from the client's namespace until :meth:`stop`."""

    kind = "tcp"

    def __init__(self, target: str = GUEST_IP, port: int = SINK_PORT,
                 connect_timeout: float = 10.0) -> None:
        self.target = (target, port)
        self.connect_timeout = connect_timeout
        self.samples = TcpSamples()
        self.sent = 0
        self.retransmits = 0
        self.started: float | None = None  # connected
        self.error: str | None = None
        self.error_at: float | None = None
        self.finished: dict[str, Any] = {}
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Connect (raises OSError when the guest's sink does not answer) and send."""
        def make() -> socket.socket:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)

        s = netns.call_in(HOSTS["client"], make)
        s.settimeout(self.connect_timeout)
        try:
            s.connect(self.target)
        except OSError:
            s.close()
            raise
        s.settimeout(0.2)
        self._sock = s
        self.started = time.time()
        self.samples.points.append((self.started, 0))
        for fn in (self._send, self._sample):
            t = threading.Thread(target=fn, name=f"tcpstream-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def _send(self) -> None:
        assert self._sock is not None
        buf = memoryview(bytes(CHUNK))
        while not self._stop.is_set():
            try:
                n = self._sock.send(buf)
            except TimeoutError:  # send buffer full for 0.2 s (guest paused): go on
                continue
            except OSError as e:
                self.error, self.error_at = f"{type(e).__name__}: {e}", time.time()
                return
            self.sent += n

    def _sample(self) -> None:
        assert self._sock is not None
        while not self._stop.wait(SAMPLE_S):
            self._take_sample()

    def _take_sample(self) -> None:
        assert self._sock is not None
        with contextlib.suppress(OSError):
            acked, self.retransmits = tcp_info(self._sock)
            self.samples.points.append((time.time(), acked))

    def stop(self, drain: float = 3.0) -> None:
        """Stop sending; wait up to ``drain`` s for the guest to ack what was sent,
        then close the connection in order (the guest's sink sees an end of file)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        if self._sock is None:
            return
        deadline = time.monotonic() + drain
        acked = None
        while time.monotonic() < deadline and self.error is None:
            with contextlib.suppress(OSError):
                acked, self.retransmits = tcp_info(self._sock)
            if acked is not None and acked >= self.sent:
                break
            time.sleep(0.02)
        self.finished = {"drained": acked is not None and acked >= self.sent,
                         "acked_at_close": acked}
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._sock.close()

    def summary(self, t_migrate: float | None, t_done: float | None,
                t_cont: float | None, t_end: float,
                hold: tuple[float, float] | None = None) -> dict[str, Any]:
        """Throughput before the migration, while RAM was copied (to the destination
        being done), after the guest resumed, and the longest stall around the
        migration (minus the RAM-check hold, when the stall spans it)."""
        s = self.samples

        def bps(v: float | None) -> int | None:
            return None if v is None else round(v * 8)

        gap = None
        if t_migrate is not None:
            gap = longest_stall(s.progress_times(), t_migrate, t_end)
        stall = stall_without_hold(gap, hold)
        before_acked = None if t_migrate is None else s.acked_at(t_migrate)
        after_acked = None
        if t_cont is not None and s.points:
            a = s.acked_at(t_cont)
            after_acked = None if a is None else int(s.points[-1][1] - a)
        return {
            "kind": "tcp", "port": self.target[1],
            "bytes_sent": self.sent,
            "bytes_acked": s.points[-1][1] if s.points else 0,
            "bytes_acked_before_migration": None if before_acked is None
            else int(before_acked),
            "bytes_acked_after_switchover": after_acked,
            "retransmits": self.retransmits,
            "connection": "error" if self.error else "survived",
            "error": self.error,
            "error_at_s": None if self.error_at is None or t_migrate is None
            else round(self.error_at - t_migrate, 3),
            "before_migration_bps": bps(s.rate(self.started, t_migrate or t_end)),
            "during_migration_bps": bps(s.rate(t_migrate, t_done or t_end))
            if t_migrate is not None else None,
            "after_switchover_bps": bps(s.rate(t_cont, t_end)),
            "longest_stall_ms": None if stall is None else round(stall * 1000.0, 1),
            "longest_stall_raw_ms": None if gap is None else round(gap.seconds * 1000.0, 1),
            "longest_stall_at_s": None if gap is None or t_migrate is None
            else round(gap.start - t_migrate, 3),
            **self.finished,
        }
