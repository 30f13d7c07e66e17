"""Host side of the guest agent channel (docs/agent-protocol.md).

Each VM has its own channel; the guest writes heartbeats and cumulative workload
counters, and the host timestamps every line on arrival with its own clock. The
guest's clock stops while the VM is paused, the host's does not: that is how the
guest-visible pause and the throughput dip are measured from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.errors import VMError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RateSample:
    t: float  # host time.time() at arrival
    mem_bytes: int
    disk_bytes: int
    verify_blocks: int
    source: str  # which VM's channel it came from
    net_bytes: int = 0  # bytes the guest's TCP sink received (cumulative)

    @property
    def work(self) -> int:
        """The throughput counter: bytes of memory dirtied plus bytes written to disk."""
        return self.mem_bytes + self.disk_bytes


class AgentLink:
    """Reads one VM's agent channel in the background and keeps what it saw."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.heartbeats: list[float] = []
        self.rates: list[RateSample] = []
        self.hello: dict[str, Any] | None = None
        self.errors: list[str] = []
        self.verify_errors: list[dict[str, Any]] = []
        self.tcp_events: list[dict[str, Any]] = []  # the TCP sink's tcp_open/tcp_close
        self.ready = asyncio.Event()
        self.closed = asyncio.Event()
        self._pongs: dict[str, asyncio.Future[float]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None

    async def connect(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(str(self.path))
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > deadline:
                    raise VMError(f"{self.name}: agent channel {self.path}: {e}") from e
                await asyncio.sleep(0.05)
        self._task = asyncio.create_task(self._read_loop(), name=f"agent-{self.name}")

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                self.handle_line(line.decode(errors="replace"), time.time())
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.set()

    def handle_line(self, line: str, now: float) -> None:
        """Record one line from the guest (public so it can be fed in unit tests)."""
        line = line.strip()
        if not line.startswith("{"):
            return
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            log.debug("%s: unparsable agent line %r", self.name, line)
            return
        ev = msg.get("ev")
        if ev == "hb":
            self.heartbeats.append(now)
        elif ev == "rate":
            self.rates.append(RateSample(
                t=now, mem_bytes=int(msg.get("mem_bytes", 0)),
                disk_bytes=int(msg.get("disk_bytes", 0)),
                verify_blocks=int(msg.get("verify_blocks", 0)), source=self.name,
                net_bytes=int(msg.get("net_bytes", 0)),
            ))
        elif ev in ("tcp_open", "tcp_close"):
            msg["t"] = now
            self.tcp_events.append(msg)
        elif ev == "hello":
            self.hello = msg
        elif ev == "ready":
            self.ready.set()
        elif ev == "pong":
            fut = self._pongs.pop(str(msg.get("token")), None)
            if fut is not None and not fut.done():
                fut.set_result(now)
        elif ev == "verify_error":
            msg["t"] = now
            self.verify_errors.append(msg)
            log.error("%s: guest checker: %s", self.name, line)
        elif ev == "error":
            self.errors.append(str(msg.get("msg")))
            log.warning("%s: guest agent error: %s", self.name, msg.get("msg"))

    async def send(self, command: str) -> None:
        if self._writer is None:
            raise VMError(f"{self.name}: agent channel not connected")
        self._writer.write(command.encode() + b"\n")
        await self._writer.drain()

    async def ping(self, token: str, timeout: float = 5.0) -> float:
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pongs[token] = fut
        await self.send(f"ping {token}")
        return await asyncio.wait_for(fut, timeout)

    def last_rate_time(self) -> float | None:
        return self.rates[-1].t if self.rates else None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
