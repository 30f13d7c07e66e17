"""Where the pause goes: timestamps from both QEMUs, folded into a breakdown.

The old QEMU reports ``STOP`` and the ``MIGRATION`` status changes as QMP events
(QEMU's wall clock, microseconds). The new QEMU is asked for a few trace points in
a log file (``-msg timestamp=on -D FILE -trace enable=...``): when it read the CPR
state (the fds), when it finished loading the device state and when the guest ran
again. All clocks are the host's wall clock, so they can be subtracted.

    issue ─stop─▶ STOP ─state─▶ source done ─load─▶ loaded ─resume─▶ running
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_EVENTS = ("cpr_state_load", "loadvm_state_setup", "process_incoming_migration_co_end",
                "vm_state_notify")


def trace_args(log: Path) -> list[str]:
    """Options that make the new QEMU log the trace points the breakdown needs."""
    out = ["-msg", "timestamp=on", "-D", str(log)]
    for ev in TRACE_EVENTS:
        out += ["-trace", f"enable={ev}"]
    return out


def parse_trace(text: str) -> dict[str, float]:
    """First time of each trace point (``vm_state_notify`` only for running=1)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 2 or not parts[0].endswith("Z"):
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.UTC).timestamp()
        except ValueError:
            continue
        name = parts[1]
        if name == "vm_state_notify":
            if not (len(parts) > 2 and parts[2].startswith("running 1")):
                continue
            name = "running"
        out.setdefault(name, t)
    return out


def event_times(events: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """First time of ``STOP`` and of each ``MIGRATION`` status in QMP events."""
    out: dict[str, float] = {}
    for ev in events:
        ts = ev.get("timestamp") or {}
        t = float(ts.get("seconds", 0)) + float(ts.get("microseconds", 0)) / 1e6
        name = str(ev.get("event"))
        if name == "MIGRATION":
            name = f"migration-{(ev.get('data') or {}).get('status')}"
        out.setdefault(name, t)
    return out


@dataclass(frozen=True)
class Breakdown:
    """Milliseconds of each step of the switch (None where not observed)."""

    stop_ms: float | None  # migrate issued -> old vCPUs stopped
    state_ms: float | None  # stopped -> old QEMU wrote its state (device state, fds)
    load_ms: float | None  # old done -> new QEMU loaded the state (re-opened devices)
    resume_ms: float | None  # loaded -> guest running in the new QEMU
    paused_ms: float | None  # old stopped -> new running: the QEMU-side pause
    new_started_s: float | None  # the new QEMU's CPR/incoming set-up, before the pause
    stop_seen: bool = True  # False: no STOP event (lost at exec), pause from ``migrate``

    def as_dict(self) -> dict[str, float | bool | None]:
        return {"stop_event_seen": self.stop_seen, "stop_ms": self.stop_ms,
                "state_transfer_ms": self.state_ms,
                "device_load_ms": self.load_ms, "resume_ms": self.resume_ms,
                "qemu_pause_ms": self.paused_ms, "new_qemu_setup_s": self.new_started_s}


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000.0, 1)


def breakdown(t_issue: float, old: Mapping[str, float], new: Mapping[str, float],
              t_new_started: float | None = None) -> Breakdown:
    stop = old.get("STOP")
    done = old.get("migration-completed")
    loaded = new.get("process_incoming_migration_co_end")
    running = new.get("running")
    setup = None
    if t_new_started is not None and new.get("cpr_state_load") is not None:
        setup = round(new["cpr_state_load"] - t_new_started, 3)
    return Breakdown(stop_ms=_ms(t_issue, stop), state_ms=_ms(stop, done),
                     load_ms=_ms(done, loaded), resume_ms=_ms(loaded, running),
                     paused_ms=_ms(t_issue if stop is None else stop, running),
                     new_started_s=setup, stop_seen=stop is not None)
