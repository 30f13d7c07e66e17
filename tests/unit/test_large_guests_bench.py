"""bench/large_guests.py: figures from a report, medians, the sync slope (no VM)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("large_guests", ROOT / "bench/large_guests.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["large_guests"] = mod
    spec.loader.exec_module(mod)
    return mod


REPORT = {
    "outcome": "completed", "total_time_s": 12.0, "downtime_ms": 40, "guest_pause_ms": 90.0,
    "ram_transferred_bytes": 300 << 20, "rounds": 5,
    "cpu_seconds": {"source": 9.0, "destination": 2.0, "source_migration_threads": 8.0},
    "consistency": {"ram": "ok"},
    "settings": {"memory": 4 << 30, "capabilities": {"multifd": True}},
    "encoding": None,
    "events": [{"t": 2.0, "event": "guest ready", "boot_s": 3.5}],
    "qemu_trace": {"first_byte_s": 0.005, "sync_ms_median": 0.3, "final_sync_ms": 0.2,
                   "sync_count": 6, "ram_save_complete_ms": 30.0,
                   "syncs": [{"t_s": 0.0, "ms": 0.2, "dirty_pages": 0}],
                   "downtime_steps_ms": {"dst_load": 50.0}},
}


def test_figures_per_gib_and_trace():
    lg = _bench()
    f = lg.figures(REPORT)
    assert f["mig_cpu_s_per_gib"] == 2.0 and f["dst_cpu_s_per_gib"] == 0.5
    assert f["sent_mib"] == 300.0 and f["boot_s"] == 3.5
    assert f["first_byte_s"] == 0.005 and f["dst_load_ms"] == 50.0 and f["multifd"] is True


def test_medians_keep_links_apart_and_slope():
    lg = _bench()
    runs = []
    for link, total in (("10gbit", 10.0), ("10gbit", 14.0), ("local", 5.0)):
        r = lg.figures(REPORT) | {"total_s": total}
        runs.append(r | {"series": "writer", "profile": "upstream", "size_gib": 4, "link": link})
    rows = lg.aggregate(runs)
    assert [(r["series"], r["total_s"], r["runs"]) for r in rows] == [
        ("writer, link 10gbit", 12.0, 2), ("writer, link local", 5.0, 1)]
    assert lg.sync_slope({1: [1.0, 1.2], 4: [1.3], 16: [2.6]}) is not None
    assert abs(lg.sync_slope({1: [1.0], 3: [3.0]}) - 1.0) < 1e-9
    md = lg.markdown({"meta": {}, "runs": runs, "starts": [
        {"size_gib": 4, "prealloc_threads": 2, "qmp_ready_s": 1.0, "guest_ready_s": 3.0}]})
    assert "writer, link local: `upstream`" in md and "| 4G | 2 | 1 |" in md
