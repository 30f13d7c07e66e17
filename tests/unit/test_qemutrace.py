"""QEMU trace parsing (bitmap syncs, downtime steps) on a recorded log excerpt."""

from __future__ import annotations

import datetime
from pathlib import Path

from livemig.lab import qemutrace

SRC = """\
2026-11-23T12:00:00.100000Z migration_bitmap_sync_start
2026-11-23T12:00:00.100400Z migration_bitmap_sync_end dirty_pages 0
2026-11-23T12:00:00.101000Z migration_thread_setup_complete
2026-11-23T12:00:03.000000Z migration_bitmap_sync_start
2026-11-23T12:00:03.002000Z migration_bitmap_sync_end dirty_pages 1234
2026-11-23T12:00:03.500000Z vmstate_downtime_checkpoint src-downtime-start
2026-11-23T12:00:03.500500Z vmstate_downtime_checkpoint src-vm-stopped
2026-11-23T12:00:03.501000Z migration_bitmap_sync_start
2026-11-23T12:00:03.509000Z migration_bitmap_sync_end dirty_pages 77
2026-11-23T12:00:03.540000Z vmstate_downtime_save type=iterable idstr=ram \
instance_id=0 downtime=38000
2026-11-23T12:00:03.540000Z vmstate_downtime_checkpoint src-iterable-saved
2026-11-23T12:00:03.542000Z vmstate_downtime_checkpoint src-non-iterable-saved
2026-11-23T12:00:03.550000Z vmstate_downtime_checkpoint src-downtime-end
2026-11-23T12:00:03.550001Z qemu-system-x86_64: terminating on signal 15
"""
DST = """\
2026-11-23T12:00:00.050000Z loadvm_state_setup
2026-11-23T12:00:03.570000Z vmstate_downtime_checkpoint dst-precopy-loadvm-completed
2026-11-23T12:00:03.570100Z vmstate_downtime_checkpoint dst-precopy-bh-enter
2026-11-23T12:00:03.900000Z vm_state_notify running 0 reason 9 (running)
2026-11-23T12:00:04.000000Z vm_state_notify running 1 reason 9 (running)
"""
T_MIGRATE = datetime.datetime(2026, 11, 23, 12, 0, 0, 90000, tzinfo=datetime.UTC).timestamp()


def test_syncs_are_paired_and_the_final_one_is_inside_the_pause():
    src, dst = qemutrace.parse(SRC), qemutrace.parse(DST)
    assert [ln.name for ln in src][-1] == "vmstate_downtime_checkpoint"  # error line skipped
    ss = qemutrace.syncs(src)
    assert [s.dirty_pages for s in ss] == [0, 1234, 77]
    assert round(ss[1].ms, 3) == 2.0
    out = qemutrace.summarize(src, dst, T_MIGRATE)
    assert out["sync_count"] == 3
    assert out["final_sync_ms"] == 8.0
    assert out["sync_ms_median"] == 1.2  # the two live ones: 0.4 and 2.0
    assert out["first_byte_s"] == 0.011
    assert out["syncs"][0] == {"t_s": 0.01, "ms": 0.4, "dirty_pages": 0}
    steps = out["downtime_steps_ms"]
    assert steps["stop"] == 0.5
    assert steps["iterable"] == 39.5
    assert steps["devices"] == 2.0
    assert steps["qemu_downtime"] == 50.0
    assert steps["dst_load"] == 28.0
    assert steps["stop_to_dst_running"] == 500.0  # the running-1 notify, not running-0
    assert out["ram_save_complete_ms"] == 38.0


def test_missing_trace_gives_empty_figures(tmp_path: Path):
    lines = qemutrace.read(tmp_path / "nothing.trace")
    out = qemutrace.summarize(lines, lines, None)
    assert out["sync_count"] == 0 and out["final_sync_ms"] is None
    assert out["downtime_steps_ms"]["qemu_downtime"] is None


def test_preset_expands_and_args_name_the_log(tmp_path: Path):
    events = qemutrace.expand(["bitmap", "migration_bitmap_sync_start", "ram_load_loop"])
    assert events[0] == "migration_bitmap_sync_start"
    assert events.count("migration_bitmap_sync_start") == 1
    assert events[-1] == "ram_load_loop"
    args = qemutrace.trace_args(tmp_path / "x.trace", ["bitmap"])
    assert args[:4] == ["-msg", "timestamp=on", "-D", str(tmp_path / "x.trace")]
    assert "enable=vmstate_downtime_checkpoint" in args
