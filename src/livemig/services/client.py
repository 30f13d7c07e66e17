"""A load generator running as a subprocess (on the testbed's client host: inside its
network namespace) that prints one line per second; a reader thread turns the lines
into a throughput series the report uses like the guest agent's counters."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tick:
    """One second of client-side throughput."""

    t: float  # host time at the end of the interval
    ops: float  # operations (transactions, requests) completed in the interval
    latency_ms: float | None = None
    failed: int = 0  # operations that failed in the interval


@dataclass(frozen=True)
class WorkSample:
    """Operations completed so far at host time ``t`` (metrics.WorkSample)."""

    t: float
    work: float


@dataclass
class ClientSeries:
    """What the client saw: per-second ticks, errors, disconnects, final checks."""

    ticks: list[Tick] = field(default_factory=list)
    errors: int = 0
    disconnects: int = 0
    messages: list[str] = field(default_factory=list)  # error lines, first 20
    check: dict[str, int] | None = None  # after-run data check (redis)

    def cumulative(self) -> list[tuple[float, float]]:
        """(time, operations so far): the counter the throughput metrics read."""
        out, total = [], 0.0
        if self.ticks:
            out.append((self.ticks[0].t - 1.0, 0.0))
        for tk in self.ticks:
            total += tk.ops
            out.append((tk.t, total))
        return out

    def samples(self) -> list[WorkSample]:
        return [WorkSample(t, w) for t, w in self.cumulative()]

    def note(self, message: str) -> None:
        if len(self.messages) < 20:
            self.messages.append(message)


LineParser = Callable[[str, float, ClientSeries], None]


class LoadProcess:
    """Runs ``argv`` and feeds each stdout/stderr line with its arrival time to
    ``parse``; ``stop()`` ends it (SIGINT first, so it can finish its checks)."""

    def __init__(self, name: str, argv: list[str], parse: LineParser) -> None:
        self.name = name
        self.argv = argv
        self.parse = parse
        self.series = ClientSeries()
        self.proc: subprocess.Popen[str] | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        log.info("%s: %s", self.name, " ".join(self.argv))
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        for stream in (self.proc.stdout, self.proc.stderr):
            th = threading.Thread(target=self._read, args=(stream,), daemon=True,
                                  name=f"{self.name}-reader")
            th.start()
            self._threads.append(th)

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            line = line.rstrip("\n")
            if not line:
                continue
            with self._lock:
                try:
                    self.parse(line, time.time(), self.series)
                except (ValueError, KeyError) as e:
                    log.debug("%s: unparsed line %r: %s", self.name, line, e)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> ClientSeries:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: finish, check, report
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        for th in self._threads:
            th.join(timeout=5)
        return self.series
