"""Measure what the migration link really carries: one TCP bulk transfer src → dst."""

from __future__ import annotations

import socket
import threading
import time

from livemig.testbed import netns
from livemig.testbed.topology import HOSTS, MIG_ADDR

_PORT = 5201
_CHUNK = 256 << 10


def measure(seconds: float = 2.0, warmup: float = 0.3) -> float:
    """Bytes per second received by dst over ``seconds`` (after a short warmup)."""
    server = netns.call_in(HOSTS["dst"], _listen)
    got: dict[str, float] = {}

    def receive() -> None:
        conn, _ = server.accept()
        conn.settimeout(seconds + 10)
        total, t_start, n0 = 0, 0.0, 0
        t0 = time.monotonic()
        try:
            while True:
                data = conn.recv(_CHUNK)
                if not data:
                    break
                total += len(data)
                now = time.monotonic()
                if not t_start and now - t0 >= warmup:
                    t_start, n0 = now, total
        finally:
            conn.close()
        t_end = time.monotonic()
        if t_start:
            got["rate"] = (total - n0) / (t_end - t_start)

    rx = threading.Thread(target=receive, daemon=True)
    rx.start()
    client = netns.call_in(HOSTS["src"], lambda: socket.create_connection(
        (MIG_ADDR["dst"], _PORT), timeout=5))
    buf = bytes(_CHUNK)
    end = time.monotonic() + warmup + seconds
    try:
        while time.monotonic() < end:
            client.sendall(buf)
    finally:
        client.close()
    rx.join(timeout=15)
    server.close()
    return got.get("rate", 0.0)


def _listen() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((MIG_ADDR["dst"], _PORT))
    s.listen(1)
    s.settimeout(10)
    return s
