"""A libvirt run as the engine's immutable :class:`MigrationRecord` plus
:class:`LibvirtFacts`; the report comes from :func:`livemig.report.build_report`,
as for lab and attach runs (one record, one report builder).

What maps where:

- timestamps: ``t_migrate`` when ``virDomainMigrateToURI3`` was called, ``t_end`` when
  it returned; with a held-paused destination (``VIR_MIGRATE_PAUSED``, copied disks
  compared) ``t_dst_done`` = ``t_end`` and ``t_cont`` when livemig resumed it, so
  ``verify_hold_ms`` is the comparison's hold. ``t_ram``: when QEMU's own migration
  began (after libvirt's begin/prepare and any disk copy), anchored from a passthrough
  ``query-migrate``; ``t_switch``: the source paused for the switchover (libvirt's
  lifecycle event); ``libvirt.phases`` splits the call's wall clock at them
  (:func:`phases`: ``prepare_s``, ``migration_s``: QEMU's migration, the figure to set
  beside an attach run's time, ``finish_s``: libvirt's finish and confirm);
- ``final_stats``: libvirt's completed-job statistics in QEMU's ``query-migrate``
  shape (``setup-time``, ``downtime``, ``ram.transferred/total/dirty-sync-count``),
  falling back to the last poll; no ``total-time``, so ``total_time_s`` is the wall
  clock of the libvirt call (its prepare, the disk copy and RAM), as before;
  libvirt's own statistics stay in ``qemu_final_stats`` (``LibvirtFacts.job_stats``);
- the pause breakdown: ``downtime_ms`` is QEMU's (through libvirt);
  ``guest_pause_ms`` is None (no livemig agent in a domain);
- the RAM verdict is QEMU's in-stream check, kept in ``LibvirtFacts.ram_check``
  (see there), the copied disks' comparison in ``LibvirtFacts.disk_check``.
"""

from __future__ import annotations

from typing import Any

from livemig.engine.record import MigrationRecord
from livemig.report import LibvirtFacts, build_report
from livemig.virt.run import DomainRun


def final_stats(job: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """libvirt's completed-job statistics (``memory_processed``, ...) in the shape of
    QEMU's ``query-migrate``; the last poll where libvirt gave none (a failure)."""
    out: dict[str, Any] = {}
    if job.get("setup_time") is not None:
        out["setup-time"] = job["setup_time"]
    if job.get("downtime") is not None:
        out["downtime"] = job["downtime"]
    out["ram"] = {"transferred": job.get("memory_processed", last.get("transferred")),
                  "total": job.get("memory_total"),
                  "dirty-sync-count": job.get("memory_iteration", last.get("rounds"))}
    return out


NO_AGENT = "no livemig agent or probe in a libvirt domain"
ABSENT = {
    "guest_pause_ms": NO_AGENT, "guest_pause_raw_ms": NO_AGENT,
    "network_pause_ms": NO_AGENT, "probes_lost": NO_AGENT,
    "disk_dirty_amplification": "libvirt's NBD mirror does not report the bytes the "
                                "guest wrote beside the copy",
    "cpu_seconds.source_migration_threads": "the source QEMU's threads may be on "
                                            "another host: only the whole process's "
                                            "CPU time (virDomainGetInfo)",
    "pinning": "libvirt 9.0 refuses pinEmulator/pinVcpu beside a migration job",
    "qemu_trace": "the domain's QEMU is not started by livemig",
}


def freeze(r: DomainRun) -> tuple[MigrationRecord, LibvirtFacts]:
    """The run's record (written once, at the end) and what only libvirt knows."""
    o = r.opts
    last = r.timeline[-1] if r.timeline else {}
    plan = r.plan
    held = r.t_cont is not None
    rec = MigrationRecord(
        run_id=r.run_id, uri=o.dst_uri, t0=r.t0, t_migrate=r.t_migrate, t_ram=r.t_qemu,
        t_end=r.t_end or r.t_migrate or r.t0,
        t_dst_done=r.t_end if held else None, t_cont=r.t_cont,
        outcome=r.result.outcome, reason=r.result.reason,
        final_stats=final_stats(r.completed_stats, last),
        settings={"capabilities": dict(plan.src_caps) if plan else {},
                  "parameters": dict(plan.src_qmp) if plan else {},
                  "livemig": {}},
        timeline=tuple(r.timeline), events=tuple(r.events), ram=None,
        verify=o.request.verify, source_after=r.source_after,
        restored=({"source": r.source_after["restored"]}
                  if r.source_after and "restored" in r.source_after else {}),
        cpu=dict(r.cpu),
        destination_status=(None if not r.destination else
                            "running" if r.destination.get("running") else "paused"),
        plan=r.engine_plan, encoding=r.encoding)
    facts = LibvirtFacts(
        libvirt={**r.libvirt, "phases": phases(r)}, job_stats=dict(r.completed_stats),
        ram_check=r.ram_check or {"result": "skipped", "why": "not checked"},
        disk_check=r.disk_check or {"result": "skipped",
                                    "why": f"storage {o.request.storage}"},
        disk_transferred_bytes=max(int(r.completed_stats.get("disk_processed") or 0),
                                   int(last.get("disk_transferred") or 0)),
        destination=dict(r.destination),
        settings={"profile": o.profile, "wanted": dict(o.wanted),
                  "libvirt_plan": plan.as_dict() if plan else None,
                  "domain": o.domain, "connect": o.src_uri, "to": o.dst_uri,
                  "storage": o.request.storage, "bandwidth": o.request.bandwidth,
                  "max_time": o.max_time, "verify": o.request.verify,
                  "unsafe": o.request.unsafe},
        absent=_absent(r))
    return rec, facts


def phases(r: DomainRun) -> dict[str, float | None]:
    """The libvirt call's wall clock split where QEMU's own migration began and ended:
    ``prepare_s`` (the destination QEMU's start, the disk copy), ``migration_s``
    (QEMU's ``migrate`` to its completion, the source's pause for the switchover plus
    QEMU's downtime: what an attach run's ``total_time_s`` counts) and ``finish_s``
    (libvirt's finish and confirm after it: the destination resumed, the source QEMU
    stopped). Without the switchover's event, ``migration_s`` runs to the call's
    return and ``finish_s`` is None."""
    none: dict[str, float | None] = {"prepare_s": None, "migration_s": None,
                                     "finish_s": None}
    if r.t_migrate is None or r.t_end is None or r.t_qemu is None:
        return none
    start = max(r.t_qemu, r.t_migrate)
    down = r.completed_stats.get("downtime")
    done = (None if r.t_switch is None or not isinstance(down, (int, float))
            else min(r.t_end, r.t_switch + down / 1000.0))
    return {"prepare_s": round(max(0.0, r.t_qemu - r.t_migrate), 3),
            "migration_s": round((done or r.t_end) - start, 3),
            "finish_s": None if done is None else round(r.t_end - done, 3)}


def _absent(r: DomainRun) -> dict[str, str]:
    """Why each figure a libvirt run cannot know is None."""
    out = dict(ABSENT)
    if r.result.outcome != "completed":
        out["downtime_ms"] = "the migration did not complete"
    if r.t_cont is None:
        out["verify_hold_ms"] = ("the destination was not held for a disk comparison"
                                 if not r.disk_check or r.disk_check.get("result") != "mismatch"
                                 else "held paused for good: the disks differ")
    return out


def report(r: DomainRun) -> dict[str, Any]:
    """The run's report: :func:`build_report` of its record and facts."""
    rec, facts = freeze(r)
    return build_report(rec, facts)

