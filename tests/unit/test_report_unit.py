"""The report reads the engine's record; lab and attach reports have the same keys."""

from __future__ import annotations

from livemig.engine.plan import Plan
from livemig.engine.record import MigrationRecord
from livemig.engine.verify import RamVerdict
from livemig.report import CONTRACT_KEYS, AttachFacts, LabFacts, build_report, summary


def _record(outcome: str = "completed") -> MigrationRecord:
    return MigrationRecord(
        run_id="r1", uri="tcp:127.0.0.1:1", t0=100.0, t_migrate=101.0, t_ram=101.0,
        t_end=110.0, t_dst_done=105.0, t_cont=105.25, outcome=outcome, reason=None,
        final_stats={"downtime": 40, "total-time": 4000, "ram": {
            "transferred": 1 << 20, "total": 1 << 30, "dirty-sync-count": 3}},
        settings={"capabilities": {"events": True}, "parameters": {}, "livemig": {}},
        ram=RamVerdict("ok", "digest", pages_compared=10, bytes_compared=40960),
        plan=Plan("tcp:127.0.0.1:1", profile="upstream"))


def test_lab_and_attach_reports_have_the_same_keys():
    lab = LabFacts(workload={"spec": "idle"}, pause={"guest_pause_ms": 1.0,
                   "guest_pause_raw_ms": 2.0, "verify_hold_ms": 250.0}, network={},
                   disk={"disk_transferred_bytes": 0, "disk_dirty_amplification": None},
                   disk_check={"result": "skipped"}, guest="skipped", guest_errors=[],
                   migration_thread_cpu=0.5, encoding=None,
                   settings={"memory": 1 << 30})
    a = build_report(_record(), lab)
    b = build_report(_record(), AttachFacts({"src_qmp": "/x"}))
    assert set(a) == set(b)
    assert set(a["consistency"]) == set(b["consistency"])
    assert set(a["cpu_seconds"]) == set(b["cpu_seconds"])
    for key in CONTRACT_KEYS:
        assert key in b
    assert b["verify_hold_ms"] == 250.0  # from the record's timestamps
    assert b["downtime_ms"] == 40 and b["rounds"] == 3 and b["total_time_s"] == 4.0
    assert b["consistency"]["ram"] == "ok" and b["workload"]["spec"] is None
    assert "RAM ok (digest)" in summary(b)


def test_no_downtime_for_an_aborted_record():
    r = build_report(_record("aborted"), AttachFacts())
    assert r["downtime_ms"] is None and r["outcome"] == "aborted"
