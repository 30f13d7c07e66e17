"""QEMU's own trace points around a migration: bitmap syncs and the downtime steps.

QEMU does not report how long a dirty-bitmap sync takes, nor where its downtime
goes; its trace points do (``migration_bitmap_sync_start/end`` around every sync,
``vmstate_downtime_checkpoint`` at each step of the stop-and-copy on both ends).
The lab asks both QEMUs for them in a log file (``-msg timestamp=on -D FILE -trace
enable=...``; the default ``log`` trace backend prints ``ISO-TIME name args`` in the
host's wall clock, so they subtract from livemig's own timestamps).

Parsing is pure (text in, frozen values out) so it is unit-tested without a VM.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The trace points a large-guest run needs on the source and the destination.
SOURCE_EVENTS: tuple[str, ...] = (
    "migration_bitmap_sync_start", "migration_bitmap_sync_end",
    "vmstate_downtime_checkpoint", "migration_thread_setup_complete",
    "migration_completion_vm_stop", "vmstate_downtime_save",
)
DESTINATION_EVENTS: tuple[str, ...] = ("vmstate_downtime_checkpoint", "loadvm_state_setup",
                                       "ram_load_complete", "vm_state_notify")
#: ``livemig migrate --qemu-trace bitmap`` asks for these on both ends.
PRESET: dict[str, tuple[str, ...]] = {
    "bitmap": tuple(dict.fromkeys(SOURCE_EVENTS + DESTINATION_EVENTS)),
}


@dataclass(frozen=True)
class Line:
    """One trace record: host wall-clock time (s), trace point, its text."""

    t: float
    name: str
    args: str


@dataclass(frozen=True)
class Sync:
    """One dirty-bitmap sync on the source."""

    start: float
    end: float
    dirty_pages: int | None  # pages the guest dirtied in the period the sync closed

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1000.0


def trace_args(log: Path, events: Iterable[str]) -> list[str]:
    """QEMU options that write ``events`` with timestamps into ``log``."""
    out = ["-msg", "timestamp=on", "-D", str(log)]
    for ev in expand(events):
        out += ["-trace", f"enable={ev}"]
    return out


def expand(events: Iterable[str]) -> tuple[str, ...]:
    """Trace point names, with presets (``bitmap``) replaced by their points."""
    out: list[str] = []
    for ev in events:
        out += PRESET.get(ev, (ev,))
    return tuple(dict.fromkeys(out))


def parse(text: str) -> list[Line]:
    """Trace records of a ``-msg timestamp=on`` log; other lines are skipped."""
    out: list[Line] = []
    for raw in text.splitlines():
        parts = raw.split(" ", 2)
        if len(parts) < 2 or not parts[0].endswith("Z") or parts[1].endswith(":"):
            continue  # error messages carry "qemu-system-x86_64:" as second word
        try:
            t = datetime.datetime.strptime(parts[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                tzinfo=datetime.UTC).timestamp()
        except ValueError:
            continue
        out.append(Line(t, parts[1], parts[2] if len(parts) > 2 else ""))
    return out


def syncs(lines: Sequence[Line]) -> list[Sync]:
    """Each ``migration_bitmap_sync_start`` paired with the next ``..._end``."""
    out: list[Sync] = []
    start: float | None = None
    for ln in lines:
        if ln.name == "migration_bitmap_sync_start":
            start = ln.t
        elif ln.name == "migration_bitmap_sync_end" and start is not None:
            pages: int | None = None
            words = ln.args.split()
            if len(words) >= 2 and words[0] == "dirty_pages" and words[1].isdigit():
                pages = int(words[1])
            out.append(Sync(start, ln.t, pages))
            start = None
    return out


def checkpoints(lines: Sequence[Line]) -> dict[str, float]:
    """First time of each ``vmstate_downtime_checkpoint`` (``src-vm-stopped``, ...),
    of the vCPUs running (``running``) and of each other trace point (by name)."""
    out: dict[str, float] = {}
    for ln in lines:
        key = ln.name
        if ln.name == "vmstate_downtime_checkpoint":
            key = ln.args.strip()
        elif ln.name == "vm_state_notify":
            if not ln.args.startswith("running 1"):
                continue
            key = "running"
        out.setdefault(key, ln.t)
    return out


def device_save_ms(lines: Sequence[Line]) -> dict[str, float]:
    """``vmstate_downtime_save``: ms each device's state took in the final pause."""
    out: dict[str, float] = {}
    for ln in lines:
        if ln.name != "vmstate_downtime_save":
            continue
        fields = dict(w.split("=", 1) for w in ln.args.split() if "=" in w)
        try:
            us = int(fields.get("downtime", ""))
        except ValueError:
            continue
        key = f"{fields.get('type', '?')}:{fields.get('idstr', '?')}"
        out[key] = round(out.get(key, 0.0) + us / 1000.0, 3)
    return out


def summarize(src: Sequence[Line], dst: Sequence[Line], t_migrate: float | None,
              max_syncs: int = 200) -> dict[str, Any]:
    """What the report keeps: every sync (relative to ``migrate``), the sync inside
    the final pause, time to the first page and the downtime steps (ms)."""
    ss = syncs(src)
    cs, cd = checkpoints(src), checkpoints(dst)
    stop = cs.get("src-downtime-start")
    final = [s for s in ss if stop is not None and s.start >= stop]
    live = [s for s in ss if stop is None or s.start < stop]
    base = t_migrate if t_migrate is not None else (ss[0].start if ss else 0.0)

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - base, 4)

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) * 1000.0, 2)

    setup = cs.get("migration_thread_setup_complete")
    return {
        "syncs": [{"t_s": rel(s.start), "ms": round(s.ms, 3), "dirty_pages": s.dirty_pages}
                  for s in ss[:max_syncs]],
        "sync_count": len(ss),
        "sync_ms_median": round(statistics.median(s.ms for s in live), 3) if live else None,
        "sync_ms_max": round(max(s.ms for s in ss), 3) if ss else None,
        "final_sync_ms": round(sum(s.ms for s in final), 3) if final else None,
        "first_byte_s": rel(setup),  # setup done: bitmaps allocated, first sync, sending
        "downtime_steps_ms": {
            # stop the vCPUs and notify devices
            "stop": span(stop, cs.get("src-vm-stopped")),
            # final bitmap sync + the rest of RAM (iterable devices)
            "iterable": span(cs.get("src-vm-stopped"), cs.get("src-iterable-saved")),
            # device state (non-iterable)
            "devices": span(cs.get("src-iterable-saved"), cs.get("src-non-iterable-saved")),
            # source done -> destination loaded everything
            "dst_load": span(cs.get("src-non-iterable-saved"),
                             cd.get("dst-precopy-loadvm-completed")),
            # destination loaded -> its bottom half ran (before the guest starts)
            "dst_bh": span(cd.get("dst-precopy-loadvm-completed"),
                           cd.get("dst-precopy-bh-enter")),
            # QEMU's own downtime figure (source side: stop -> source done)
            "qemu_downtime": span(stop, cs.get("src-downtime-end")),
            # vCPUs stopped on the source -> running on the destination (includes a
            # verify hold if the destination was started with -S)
            "stop_to_dst_running": span(stop, cd.get("running")),
        },
        "ram_save_complete_ms": device_save_ms(src).get("iterable:ram"),
    }


def read(path: Path) -> list[Line]:
    try:
        return parse(path.read_text(errors="replace"))
    except OSError:
        return []
