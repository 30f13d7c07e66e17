"""The client's probes: a UDP datagram to the guest's echo port every 10 ms.

Each probe carries its sequence number; a reply is matched to its probe, so lost and
late replies are told apart. ``network_pause_ms`` is the longest time between two
consecutive replies received while probing, the guest-visible network outage as a
client sees it.
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

ECHO_PORT = 7777
_FMT = "!4sQd"
_MAGIC = b"lmpb"


@dataclass
class ProbeStats:
    sent_at: list[float] = field(default_factory=list)  # by sequence number
    replies: list[tuple[float, int]] = field(default_factory=list)  # (arrival, seq)

    def longest_gap(self, start: float, end: float) -> tuple[float, float] | None:
        """(gap seconds, gap start) between replies in [start, end], edges included."""
        times = sorted(t for t, _ in self.replies if start <= t <= end)
        if not times:
            return None
        edges = [start, *times, end]
        best = max(range(len(edges) - 1), key=lambda i: edges[i + 1] - edges[i])
        return edges[best + 1] - edges[best], edges[best]

    @property
    def sent(self) -> int:
        return len(self.sent_at)

    def lost(self, excluding: tuple[float, float] | None = None) -> int:
        """Probes never answered, leaving out those sent inside ``excluding``."""
        answered = {s for _, s in self.replies}
        return sum(1 for seq, t in enumerate(self.sent_at) if seq not in answered
                   and not (excluding and excluding[0] <= t <= excluding[1]))

    def replies_between(self, start: float, end: float) -> int:
        return sum(1 for t, _ in self.replies if start <= t <= end)


class Prober:
    """Probes the guest from the client host in a background thread."""

    def __init__(self, interval: float = 0.01, target: str = GUEST_IP) -> None:
        self.interval = interval
        self.target = (target, ECHO_PORT)
        self.stats = ProbeStats()
        self._stop = threading.Event()
        self._sock = netns.call_in(HOSTS["client"], self._open)
        self._threads = [threading.Thread(target=self._send_loop, name="probe-send",
                                          daemon=True),
                         threading.Thread(target=self._recv_loop, name="probe-recv",
                                          daemon=True)]
        self.started: float | None = None

    @staticmethod
    def _open() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("0.0.0.0", 0))
        s.settimeout(0.2)
        return s

    def start(self) -> None:
        self.started = time.time()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=1.0)
        self._sock.close()

    def _send_loop(self) -> None:
        seq = 0
        next_t = time.monotonic()
        while not self._stop.is_set():
            now = time.time()
            with contextlib.suppress(OSError):  # no route / buffer full: counts as lost
                self._sock.sendto(struct.pack(_FMT, _MAGIC, seq, now), self.target)
            self.stats.sent_at.append(now)
            seq += 1
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            else:
                next_t = time.monotonic()

    def _recv_loop(self) -> None:
        size = struct.calcsize(_FMT)
        while not self._stop.is_set():
            try:
                data = self._sock.recv(2048)
            except (TimeoutError, OSError):
                continue
            if len(data) >= size:
                magic, seq, _ = struct.unpack(_FMT, data[:size])
                if magic == _MAGIC:
                    self.stats.replies.append((time.time(), seq))

    def summary(self, start: float, end: float,
                hold: tuple[float, float] | None = None) -> dict[str, Any]:
        """Probe results over [start, end]. ``hold`` is the time livemig itself kept
        the guest frozen for the RAM check: a gap spanning it is shortened by it and
        probes sent inside it do not count as lost (a real migration has no hold)."""
        gap = self.stats.longest_gap(start, end)
        pause = raw = None if gap is None else gap[0]
        if gap is not None and hold is not None and gap[1] <= hold[0] <= gap[1] + gap[0]:
            pause = max(gap[0] - (hold[1] - hold[0]), 0.0)
        return {
            "probe_interval_ms": self.interval * 1000.0,
            "probes_sent": self.stats.sent,
            "probes_answered": len({s for _, s in self.stats.replies}),
            "probes_lost": self.stats.lost(excluding=hold),
            "network_pause_ms": None if pause is None else round(pause * 1000.0, 1),
            "network_pause_raw_ms": None if raw is None else round(raw * 1000.0, 1),
            "network_pause_at_s": None if gap is None else round(gap[1] - start, 3),
        }
