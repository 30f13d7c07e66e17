"""A libvirt run's record and report: the engine's MigrationRecord plus LibvirtFacts,
through the one report builder, with the keys libvirt reports always had."""

from __future__ import annotations

from typing import Any

from livemig.engine.observe import Observation
from livemig.engine.record import MigrationRecord
from livemig.report import CONTRACT_KEYS, LibvirtFacts, summary
from livemig.settings import merge
from livemig.virt import plan as P
from livemig.virt import record
from livemig.virt.run import DomainOptions, DomainRun, Outcome, ram_check_failed, ram_check_ok
from livemig.virt.stats import PageRate, disk_sample, query_migrate

STOCK = P.QemuInfo(frozenset({"xbzrle", "auto-converge", "multifd"}), {},
                   frozenset({"migrate-set-parameters"}))
JOB = {"setup_time": 12, "downtime": 87, "memory_processed": 300 << 20,
       "memory_total": 256 << 20, "memory_iteration": 4, "disk_processed": 64 << 20,
       "time_elapsed": 9100}


def _run(outcome: str = "completed", storage: str = "copy", **kw: Any) -> DomainRun:
    req = P.Request(storage=storage, disks=("vda",) if storage == "copy" else ())
    opts = DomainOptions(domain="g", src_uri="qemu+tcp://a/system",
                         dst_uri="qemu+tcp://b/system", profile="defaults",
                         wanted=merge("defaults", {}), explicit=frozenset(), request=req)
    r = DomainRun(opts, t0=1000.0)
    r.plan = P.make_plan(merge("defaults", {}), frozenset(), STOCK, req)
    r.t_migrate, r.t_end = 1001.0, 1011.5
    r.result = Outcome(outcome, None if outcome == "completed" else "why")
    stats = {"memory_processed": 100 << 20, "memory_total": 256 << 20,
             "memory_remaining": 10 << 20, "memory_iteration": 2, "memory_bps": 1e7,
             "disk_total": 64 << 20, "disk_remaining": 0, "disk_processed": 60 << 20}
    r.timeline.append({**Observation.parse(5.0, query_migrate(stats)).sample(),
                       **disk_sample(stats)})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_a_completed_run_is_a_migration_record_with_libvirt_facts() -> None:
    r = _run(completed_stats=dict(JOB), t_cont=1013.0,
             ram_check=ram_check_ok({"size": 1 << 30, "source-time": 50000,
                                     "destination-time": 60000, "blocks": 1024,
                                     "chunk-size": 1 << 20}),
             disk_check={"result": "ok", "method": "nbd", "disks": {}, "hold_s": 1.4},
             destination={"running": True, "persistent": True, "gone_from_source": True},
             libvirt={"library_version": "9.0.0"}, cpu={"source": 3.0, "destination": 1.0})
    rec, facts = record.freeze(r)
    assert isinstance(rec, MigrationRecord) and isinstance(facts, LibvirtFacts)
    assert rec.final_stats["ram"] == {"transferred": 300 << 20, "total": 256 << 20,
                                      "dirty-sync-count": 4}
    assert rec.downtime_ms == 87 and rec.verify_hold_ms == 1500.0
    rep = record.report(r)
    assert set(CONTRACT_KEYS) <= set(rep)
    assert rep["mode"] == "libvirt" and rep["engine"] == "libvirt"
    assert rep["run_id"] == r.run_id and len(rep["run_id"]) == 8
    assert rep["total_time_s"] == 10.5  # the libvirt call's wall clock
    assert rep["setup_time_ms"] == 12 and rep["downtime_ms"] == 87
    assert rep["ram_transferred_bytes"] == 300 << 20 and rep["rounds"] == 4
    assert rep["disk_transferred_bytes"] == 64 << 20
    assert rep["guest_pause_ms"] is None and rep["verify_hold_ms"] == 1500.0
    assert rep["cpu_seconds"] == {"source": 3.0, "destination": 1.0,
                                  "source_migration_threads": None}
    assert rep["consistency"]["ram"] == "ok" and rep["consistency"]["disk"] == "ok"
    assert rep["consistency"]["ram_detail"]["blocks"] == 1024
    assert rep["qemu_final_stats"] == JOB  # libvirt's own figures, as before
    assert rep["destination"]["running"] is True
    assert rep["libvirt"] == {"library_version": "9.0.0",
                              "phases": {"prepare_s": None, "migration_s": None,
                                         "finish_s": None}}
    s = rep["settings"]
    assert s["domain"] == "g" and s["to"] == "qemu+tcp://b/system"
    assert s["storage"] == "copy" and s["libvirt_plan"]["disk_check"] == "auto"
    assert "paused" in s["libvirt_plan"]["flags"]
    t = rep["timeline"][0]
    assert t["transferred"] == 100 << 20 and t["disk_transferred"] == 60 << 20
    assert t["status"] == "active" and t["remaining_disk"] == 0
    assert rep["workload"]["spec"] is None
    assert rep["guest_pause_ms"] is None and "no livemig agent" in rep["absent"]["guest_pause_ms"]
    assert "downtime_ms" not in rep["absent"] and "verify_hold_ms" not in rep["absent"]
    text = summary(rep)
    assert "consistency      RAM ok (in-stream digest" in text
    assert "held 1500 ms for the disk check" in text


def test_a_failed_run_keeps_no_downtime_and_says_why() -> None:
    r = _run("failed", storage="shared",
             ram_check=ram_check_failed("x-ram-digest-check: guest RAM differs from the "
                                        "source in block pc.ram chunk 3"),
             source_after={"status": "running", "restored": {"parameters": {}}})
    rep = record.report(r)
    assert rep["outcome"] == "failed" and rep["downtime_ms"] is None
    assert rep["verify_hold_ms"] is None  # never held: libvirt resumed nothing
    assert rep["absent"]["downtime_ms"] == "the migration did not complete"
    assert rep["ram_transferred_bytes"] == 100 << 20  # the last poll's
    assert rep["consistency"]["ram"] == "mismatch"
    assert rep["consistency"]["disk"] == "skipped"
    assert rep["consistency"]["disk_detail"]["why"] == "storage shared"
    assert rep["settings_restored"] == {"source": {"parameters": {}}}
    assert rep["source_after"]["status"] == "running"
    text = summary(rep)
    assert "RAM mismatch" in text and "block pc.ram chunk 3" in text
    assert "source after     running" in text


def test_a_disk_mismatch_is_named_in_the_summary() -> None:
    r = _run(completed_stats=dict(JOB), disk_check={
        "result": "mismatch", "method": "nbd", "disks": {"vda": {
            "result": "mismatch", "mismatched_chunks": 1,
            "first_differing_chunk": {"range": ["0x300000", "0x400000"]},
            "first_differing_byte": "0x304567"}}})
    rep = record.report(r)
    assert rep["consistency"]["disk"] == "mismatch"
    assert "at byte 0x304567" in summary(rep)
    assert rep["verify_hold_ms"] is None  # not resumed: held paused for good
    assert rep["absent"]["verify_hold_ms"] == "held paused for good: the disks differ"


def test_the_call_is_split_where_qemus_own_migration_began_and_ended() -> None:
    # the call 1001.0 -> 1011.5; QEMU's migrate at 1004.2 (libvirt prepared the
    # destination QEMU for 3.2 s): the total stays the call's wall clock
    r = _run(completed_stats=dict(JOB), t_qemu=1004.2)
    rep = record.report(r)
    assert rep["libvirt"]["phases"] == {"prepare_s": 3.2, "migration_s": 7.3,
                                        "finish_s": None}
    assert rep["total_time_s"] == 10.5
    from livemig.bench import METRICS
    qemu_time = dict(METRICS)["qemu_time_s"]
    assert qemu_time(rep) == 7.3
    # the source paused for the switchover at 1009.913, QEMU's downtime 87 ms: its
    # migration ended at 1010.0, libvirt's finish and confirm took the last 1.5 s
    rep = record.report(_run(completed_stats=dict(JOB), t_qemu=1004.2, t_switch=1009.913))
    assert rep["libvirt"]["phases"] == {"prepare_s": 3.2, "migration_s": 5.8,
                                        "finish_s": 1.5}
    assert qemu_time(rep) == 5.8 and rep["total_time_s"] == 10.5
    # not anchored (no poll saw QEMU's migration): no split
    rep = record.report(_run(completed_stats=dict(JOB)))
    assert rep["libvirt"]["phases"] == {"prepare_s": None, "migration_s": None,
                                        "finish_s": None}
    assert qemu_time(rep) is None


def test_the_page_rate_is_the_growth_of_libvirts_page_counters_per_second_of_the_job() -> None:
    rate = PageRate()
    job = {"memory_page_size": 4096, "memory_normal": 1000, "memory_constant": 24,
           "time_elapsed": 2000}
    assert rate.update(job) == 0.0  # the first poll: nothing to compare with
    later = {**job, "memory_normal": 3000, "compression_pages": 48, "time_elapsed": 2500}
    assert rate.update(later) == (2000 + 48) * 4096 / 0.5
    assert rate.update(later) == 0.0  # no time went by
    assert rate.update({**job, "time_elapsed": 2600}) == 0.0  # a new job: counters went back
    assert rate.update({"memory_normal": 5}) == 0.0  # no clock
    reply = query_migrate({**later, "memory_total": 1 << 30, "memory_processed": 1},
                          page_rate=8 * 4096.0)
    assert Observation.parse(1.0, reply).page_rate == 8 * 4096.0
    assert Observation.parse(1.0, query_migrate(later)).page_rate == 0.0
