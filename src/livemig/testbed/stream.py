"""A stream of UDP datagrams from the client to the guest, echoed back by the agent.

The guest is a busybox initramfs with no iperf3; its agent echoes every datagram on
the probe port (``guest/agent/echo.c``). The client keeps a window of ``window``
datagrams of ``size`` bytes in flight (self-clocked: a new one leaves when an echo
comes back, so the stream runs as fast as the guest's NIC path allows without
overrunning it); a window whose echoes do not come back within ``timeout`` is
given up (counted as lost) and refilled. The throughput is the echoed payload per
second, so it counts both directions of the guest's NIC path.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from livemig.testbed import netns
from livemig.testbed.topology import GUEST_IP, HOSTS

ECHO_PORT = 7777  # the agent's echo (probe.ECHO_PORT)
_MAGIC = b"lmst"
_HDR = "!4sQ"
BUCKET_S = 0.1


@dataclass
class StreamStats:
    sent: int = 0
    echoed: int = 0
    lost: int = 0
    buckets: dict[int, int] = field(default_factory=dict)  # 100 ms slot -> echoed bytes

    def rate(self, start: float, end: float) -> float | None:
        """Echoed payload bytes/s in [start, end] (None: no full bucket inside)."""
        lo, hi = int(start / BUCKET_S) + 1, int(end / BUCKET_S)
        if hi <= lo:
            return None
        return sum(self.buckets.get(b, 0) for b in range(lo, hi)) / ((hi - lo) * BUCKET_S)


class Stream:
    """Runs in two threads in the client's namespace until :meth:`stop`."""

    def __init__(self, size: int = 1400, window: int = 32, timeout: float = 0.2,
                 target: str = GUEST_IP) -> None:
        self.size, self.window, self.timeout = size, window, timeout
        self.target = (target, ECHO_PORT)
        self.stats = StreamStats()
        self.started: float | None = None
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.settimeout(0.1)
            return s

        self._sock = netns.call_in(HOSTS["client"], make)
        self.started = time.time()
        for fn in (self._send, self._receive):
            t = threading.Thread(target=fn, name=f"stream-{fn.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=2)
        if self._sock is not None:
            self._sock.close()

    def _send(self) -> None:
        assert self._sock is not None
        pad = b"\0" * (self.size - struct.calcsize(_HDR))
        seq = 0
        st = self.stats
        while not self._stop.is_set():
            with self._cv:
                if st.sent - st.echoed - st.lost >= self.window:
                    if not self._cv.wait(self.timeout):
                        # nothing came back for a while: give the window up, refill it
                        st.lost = max(st.lost, st.sent - st.echoed)
                    continue
            with contextlib.suppress(OSError):
                self._sock.sendto(struct.pack(_HDR, _MAGIC, seq) + pad, self.target)
                seq += 1
                with self._cv:
                    st.sent += 1

    def _receive(self) -> None:
        assert self._sock is not None
        st = self.stats
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except (TimeoutError, OSError):
                continue
            if len(data) < 12 or data[:4] != _MAGIC:
                continue
            now = time.time()
            with self._cv:
                st.echoed += 1
                b = int(now / BUCKET_S)
                st.buckets[b] = st.buckets.get(b, 0) + len(data)
                self._cv.notify()

    def summary(self, t_ready: float, t_migrate: float | None,
                t_end: float) -> dict[str, Any]:
        """Throughput before the migration (the stream's normal rate) and during it."""
        st = self.stats
        before = st.rate(self.started or t_ready, t_migrate or t_end)
        during = st.rate(t_migrate, t_end) if t_migrate is not None else None
        return {"kind": "udp-echo", "datagram_bytes": self.size, "window": self.window,
                "sent": st.sent, "echoed": st.echoed, "lost": st.lost,
                "before_migration_bps": None if before is None else round(before * 8),
                "during_migration_bps": None if during is None else round(during * 8)}
