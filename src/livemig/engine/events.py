"""The engine's event stream: the engine emits, progress, timeline and logs listen.

Three kinds of event: ``event`` (goes into the record's ``events`` list with a
timestamp relative to the run's start), ``say`` (one human line: a phase change or
a notable decision) and ``sample`` (one parsed poll of the migration).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Event:
    kind: str  # event | say | sample
    t: float  # seconds since the stream's t0
    what: str
    data: dict[str, Any] = field(default_factory=dict)


Listener = Callable[[Event], None]


class EventStream:
    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.time() if t0 is None else t0
        self._listeners: list[Listener] = []
        self.log: list[dict[str, Any]] = []  # the record's ``events``

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _send(self, ev: Event) -> None:
        for listener in self._listeners:
            try:
                listener(ev)
            except Exception:  # a listener never breaks the migration
                log.exception("event listener failed on %s", ev.what)

    def event(self, what: str, **data: Any) -> None:
        t = round(time.time() - self.t0, 3)
        self.log.append({"t": t, "event": what, **data})
        log.info("%s %s", what, data or "")
        self._send(Event("event", t, what, data))

    def say(self, message: str) -> None:
        self._send(Event("say", round(time.time() - self.t0, 3), message))

    def sample(self, elapsed: float, sample: dict[str, Any]) -> None:
        self._send(Event("sample", elapsed, "sample", sample))


def progress_listener(progress: Any) -> Listener:
    """Adapt a :class:`livemig.progress.Progress` to the stream."""

    def listen(ev: Event) -> None:
        if ev.kind == "say":
            progress.step(ev.what)
        elif ev.kind == "sample":
            progress.sample(ev.t, ev.data)

    return listen
