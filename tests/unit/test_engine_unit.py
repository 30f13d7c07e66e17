"""The engine against scripted QMP ends: digest comparison, settings restored on
every outcome, cancel and rollback paths, the guardian's repair, the plan's checks."""

from __future__ import annotations

import asyncio

import pytest

from fakeqmp import PAGE, FakeEnd
from livemig.engine.decision import Decision
from livemig.engine.guardian import repair_ends
from livemig.engine.negotiate import EndSettings, read, restore
from livemig.engine.observe import Observation
from livemig.engine.plan import Plan
from livemig.engine.run import Engine
from livemig.engine.verify import compare_digests, verify_ram
from livemig.errors import UsageError, VMError

URI = "tcp:127.0.0.1:4444"
FAST = (("poll-interval", "0.01"),)


def ends(ram_size: int = 8 << 20, **src_kw):
    base = {"pc.ram": bytearray(ram_size), "vga.vram": bytearray(1 << 20)}
    base["pc.ram"][0x123456] = 7
    digest = {"x-query-ram-digest"}
    src = FakeEnd("src", ram={k: bytearray(v) for k, v in base.items()}, commands=digest,
                  **src_kw)
    dst = FakeEnd("dst", status="inmigrate", ram={k: bytearray(v) for k, v in base.items()},
                  commands=digest)
    return src, dst


def run(engine: Engine):
    return asyncio.run(engine.run())


# -- digest ---------------------------------------------------------------------------
def test_digest_identical_is_ok_and_costed():
    src, dst = ends()
    src.status = dst.status = "paused"
    v = asyncio.run(compare_digests(src, dst, chunk=1 << 20))
    assert v.result == "ok" and v.method == "digest"
    assert v.pages_compared == (9 << 20) // PAGE
    assert v.as_dict()["seconds_per_gib"] is not None


def test_digest_names_the_flipped_pages():
    src, dst = ends()
    src.status = dst.status = "paused"
    dst.ram["pc.ram"][0x300001] ^= 0xFF  # one page in one chunk
    dst.ram["pc.ram"][0x7FF000] ^= 0x01  # the last page of the block
    dst.ram["vga.vram"][5] ^= 0x10
    v = asyncio.run(compare_digests(src, dst, chunk=1 << 20))
    assert v.result == "mismatch"
    assert v.mismatched_pages == 3 and v.mismatched_chunks == 3
    # main RAM named by guest-physical address, other blocks by block+offset
    assert list(v.first_mismatches) == ["0x300000", "0x7ff000", "vga.vram+0x0"]
    # the drill-down asked page digests of exactly the differing chunks
    drills = [a for a in src.called("x-query-ram-digest") if "block" in a]
    assert {(a["block"], a["offset"], a["chunk-size"]) for a in drills} == {
        ("pc.ram", 0x300000, PAGE), ("pc.ram", 0x700000, PAGE), ("vga.vram", 0, PAGE)}


def test_digest_block_missing_or_resized_is_a_mismatch():
    src, dst = ends()
    src.status = dst.status = "paused"
    del dst.ram["vga.vram"]
    v = asyncio.run(compare_digests(src, dst, chunk=1 << 20))
    assert v.result == "mismatch" and "vga.vram: missing on the destination" in v.first_mismatches


def test_no_digest_and_no_ram_files_is_skipped_with_reason():
    src, dst = ends()
    src.commands = dst.commands = set()
    v = asyncio.run(verify_ram(src, dst))
    assert v.result == "skipped" and "x-query-ram-digest" in (v.why or "")


# -- whole runs -----------------------------------------------------------------------
def test_completed_run_verifies_before_resuming_and_restores_both_ends():
    src, dst = ends()
    dst.events.append({"event": "MIGRATION", "data": {"status": "completed"},
                       "timestamp": {"seconds": 1, "microseconds": 0}})
    before_src = (dict(src.caps), dict(src.params))
    plan = Plan(URI, settings=(("multifd", "on"), ("downtime-limit", "500"), *FAST),
                profile="defaults", bandwidth=64 << 20).validate()
    rec = run(Engine(src, dst, plan))
    assert rec.outcome == "completed", rec.reason
    assert rec.ram is not None and rec.ram.result == "ok"
    names = [c for c, _ in dst.log]
    # the destination was digested while paused, and only then resumed
    assert names.index("x-query-ram-digest") < names.index("cont")
    assert dst.status == "running"
    assert dst.called("migrate-incoming")[0]["exit-on-error"] is False
    assert (src.caps, src.params) == before_src
    assert dst.caps["multifd"] is False and dst.params["downtime-limit"] == 300
    assert rec.settings["parameters"]["max-bandwidth"] == 64 << 20


def test_max_time_cancels_source_runs_settings_restored():
    src, dst = ends(statuses=["active"])
    plan = Plan(URI, settings=(("auto-converge", "on"), *FAST), profile="defaults",
                max_time=0.05).validate()
    rec = run(Engine(src, dst, plan))
    assert rec.outcome == "aborted" and "max-time" in (rec.reason or "")
    assert src.called("migrate_cancel")
    assert src.status == "running" and not src.caps["auto-converge"]
    assert rec.source_after == {"running": True, "status": "running"}
    assert not dst.called("cont")  # the destination never runs the guest


def test_failed_migration_puts_a_paused_source_back_running():
    src, dst = ends(statuses=["active", "failed"])
    src_status = {"n": 0}
    orig = src.cmd

    async def cmd(command, **args):
        if command == "query-migrate" and src.statuses == ["failed"]:
            src.status = "paused"  # QEMU left the source stopped
            src_status["n"] += 1
        return await orig(command, **args)

    src.cmd = cmd  # type: ignore[method-assign]
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "failed"
    assert src.called("cont") and src.status == "running"


def test_interrupt_is_an_abort():
    src, dst = ends(statuses=["active"])
    ev = asyncio.Event()
    ev.set()
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate(),
                     interrupt=ev))
    assert rec.outcome == "aborted" and rec.reason == "interrupted"


def test_unknown_setting_is_a_usage_error_before_anything_changes():
    src, dst = ends()
    with pytest.raises(UsageError, match="unknown setting"):
        run(Engine(src, dst, Plan(URI, settings=(("no-such-knob", "1"),),
                                  profile="defaults").validate()))
    assert not src.called("migrate-set-capabilities") and not dst.called("migrate-incoming")


# -- guardian -------------------------------------------------------------------------
def _spec(src: FakeEnd, dst: FakeEnd) -> dict:
    return {"original_src": EndSettings(dict(src.caps), dict(src.params)).as_dict(),
            "original_dst": EndSettings(dict(dst.caps), dict(dst.params)).as_dict()}


def test_guardian_cancels_an_active_migration_and_restores():
    src, dst = ends(statuses=["active"])
    spec = _spec(src, dst)
    src.caps["multifd"] = True
    src.params["max-bandwidth"] = 1
    src.migrating = True
    src.commands.add("cancel-cpu-throttle")
    done = asyncio.run(repair_ends(src, dst, spec))
    assert src.called("migrate_cancel") and src.called("cancel-cpu-throttle")
    assert src.status == "running" and not src.caps["multifd"]
    assert src.params["max-bandwidth"] == 134217728
    assert not dst.called("cont"), done


def test_guardian_resumes_a_completed_destination():
    src, dst = ends(statuses=["completed"])
    src.migrating = True
    src.status, dst.status = "postmigrate", "paused"
    dst.migrating, dst.statuses = True, ["completed"]
    asyncio.run(repair_ends(src, dst, _spec(src, dst)))
    assert dst.status == "running" and not src.called("cont")


# -- plan, observation, decision ------------------------------------------------------
@pytest.mark.parametrize("kw,msg", [
    ({"uri": "http://x"}, "bad migration URI"),
    ({"uri": "tcp:h:99999"}, "port out of range"),
    ({"max_time": 0}, "--max-time"),
    ({"settings": (("throttle", "bogus"),)}, "bad --set throttle"),
    ({"settings": (("throttle", "dirty-limit"),)}, "dirty-limit needs KVM"),
    ({"settings": (("disk-check", "stream"),)}, "disk-check is for libvirt runs"),
    ({"profile": "nope"}, "unknown profile"),
])
def test_plan_rejects(kw, msg):
    args = {"uri": URI, **kw}
    with pytest.raises(UsageError, match=msg):
        Plan(**args).validate()


def test_observation_parses_once_for_snapshot_and_timeline():
    o = Observation.parse(2.0, {"status": "active", "cpu-throttle-percentage": 30, "ram": {
        "dirty-sync-count": 3, "remaining": 1000, "total": 4000, "transferred": 10,
        "dirty-pages-rate": 2, "page-size": 4096, "mbps": 8.0}})
    s = o.snapshot()
    assert (s.rounds, s.remaining, s.dirty_rate, s.bandwidth, s.throttle_pct) == (
        3, 1000, 8192.0, 1e6, 30)
    assert o.sample()["eta_s"] == pytest.approx(0.001)
    assert not o.terminal and Observation.parse(0, {"status": "cancelled"}).terminal


def test_restore_sets_back_what_changed_and_keeps_going_past_a_refusal():
    src, _ = ends()
    orig = asyncio.run(read(src))
    assert orig.capabilities["events"] is False and orig.parameters["downtime-limit"] == 300
    src.caps.update({"events": True, "multifd": True})
    src.params.update({"downtime-limit": 900, "multifd-channels": 4})
    done = asyncio.run(restore(src, orig))
    assert done["parameters"] == {"downtime-limit": 300, "multifd-channels": 2}
    assert done["capabilities"] == {"events": False, "multifd": False}
    assert src.caps["multifd"] is False and src.params["downtime-limit"] == 300
    # QEMU refuses one parameter: the others are still set back, the refusal reported
    src.params.update({"downtime-limit": 900, "max-bandwidth": 1})
    real = src.cmd

    async def refuse_bandwidth(command, **args):
        if command == "migrate-set-parameters" and "max-bandwidth" in args:
            raise VMError("src: max-bandwidth refused")
        return await real(command, **args)

    src.cmd = refuse_bandwidth  # type: ignore[method-assign]
    done = asyncio.run(restore(src, orig))
    assert done["parameters"] == {"downtime-limit": 300}
    assert done["errors"] and "max-bandwidth" in done["errors"][0]
    assert Decision("cancel") is Decision.CANCEL


def test_ram_check_method_is_obeyed(tmp_path):
    src, dst = ends()
    src.status = dst.status = "paused"
    for end in (src, dst):
        end.ram_file = tmp_path / f"{end.name}.ram"
        end.ram_file.write_bytes(bytes(8192))
    assert asyncio.run(verify_ram(src, dst)).method == "file"
    assert asyncio.run(verify_ram(src, dst, "digest")).method == "digest"
    src.ram_file = None
    v = asyncio.run(verify_ram(src, dst, "file"))
    assert v.result == "skipped" and "ram-check=file" in (v.why or "")


def test_observation_snapshot_matches_the_policies_own_parser():
    """One parser: the engine's snapshot must equal Snapshot.from_query_migrate."""
    from livemig.policy.base import Snapshot

    info = {"status": "active", "cpu-throttle-percentage": 20, "ram": {
        "dirty-sync-count": 4, "remaining": 5 << 20, "total": 1 << 30, "transferred": 9,
        "dirty-pages-rate": 300, "page-size": 4096, "mbps": 800.0,
        "pages-per-second": 25000}}
    disk = {"remaining": 1, "total": 2, "ready": True, "dirty_rate": 3.0, "write_rate": 4.0}
    assert Observation.parse(1.5, info).snapshot(disk) == Snapshot.from_query_migrate(
        1.5, info, disk)


def test_destination_gone_fails_cancels_and_source_runs_on():
    src, dst = ends(statuses=["active"])
    orig = src.cmd

    async def cmd(command, **args):
        if command == "query-migrate" and src.migrating:
            dst.dead = True  # the destination disappears during the migration
        return await orig(command, **args)

    src.cmd = cmd  # type: ignore[method-assign]
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "failed" and "destination QEMU is gone" in (rec.reason or "")
    assert src.called("migrate_cancel") and src.status == "running"
    assert "destination" not in rec.restored  # a dead end is not talked to


def test_dst_start_moves_what_the_source_holds(tmp_path):
    from livemig.dststart import destination_argv

    src = ["qemu", "-m", "1G", "-qmp", "unix:/run/a.qmp,server=on,wait=off",
           "-chardev", "socket,id=ag,path=/run/a.agent,server=on,wait=off",
           "-serial", "file:/var/log/a.console", "-daemonize", "-pidfile", "/run/a.pid",
           "-incoming", "tcp:0:1", "-drive", "file=/img/a.qcow2,if=virtio"]
    argv, qmp = destination_argv(src, tmp_path)
    text = " ".join(argv)
    for held in ("/run/a.qmp", "/run/a.agent", "/var/log/a.console", "/run/a.pid",
                 "-daemonize", "tcp:0:1"):
        assert held not in text
    assert f"path={tmp_path}/dst-ag-" in text and "file=/img/a.qcow2" in text
    assert argv[-5:] == ["-qmp", f"unix:{qmp},server=on,wait=off", "-incoming", "defer",
                         "-S"]
    with pytest.raises(UsageError, match="shared"):
        destination_argv(["qemu", "-object",
                          "memory-backend-file,id=m,mem-path=/dev/shm/x,share=on"], tmp_path)


def test_guardian_undoes_the_labs_disk_mirror_and_io_cap():
    src, dst = ends(statuses=["active"])
    src.migrating = True
    src.commands |= {"block-job-cancel", "block_set_io_throttle"}
    spec = {**_spec(src, dst), "block_job": "mirror0", "io_throttle_device": "disk"}
    asyncio.run(repair_ends(src, dst, spec))
    assert src.called("block-job-cancel") == [{"device": "mirror0", "force": True}]
    assert src.called("block_set_io_throttle")[0]["bps_wr"] == 0
    assert src.status == "running"


# -- switchover-drain (patch 0007) ----------------------------------------------------
def _negotiated(profile: str, sets: dict[str, str], *, patched: bool):
    from livemig.engine.negotiate import negotiate
    from livemig.settings import DRAIN_CAP, merge

    src, dst = ends()
    for end in (src, dst):
        end.caps["return-path"] = False
        if patched:
            end.caps[DRAIN_CAP] = False
    plan = Plan(URI, settings=tuple(merge(profile, sets).items()), profile=profile,
                explicit=frozenset(sets)).validate()
    return asyncio.run(negotiate(src, dst, plan))


def test_livemig_profile_drains_with_return_path_where_qemu_can():
    n = _negotiated("livemig", {}, patched=True)
    assert n.capabilities["x-switchover-drain"] is True
    assert n.capabilities["return-path"] is True
    # a stock QEMU: auto leaves both alone
    n = _negotiated("livemig", {}, patched=False)
    assert "x-switchover-drain" not in n.capabilities
    assert "return-path" not in n.capabilities


def test_switchover_drain_off_and_on():
    n = _negotiated("livemig", {"switchover-drain": "off"}, patched=True)
    assert n.capabilities["x-switchover-drain"] is False
    assert "return-path" not in n.capabilities
    n = _negotiated("defaults", {"switchover-drain": "on"}, patched=True)
    assert n.capabilities["x-switchover-drain"] is True
    assert n.capabilities["return-path"] is True
    assert "x-switchover-drain" not in _negotiated("defaults", {}, patched=True).capabilities
    with pytest.raises(UsageError, match="no x-switchover-drain"):
        _negotiated("upstream-plain", {"switchover-drain": "on"}, patched=False)
    with pytest.raises(UsageError, match="bad --set switchover-drain"):
        _negotiated("livemig", {"switchover-drain": "maybe"}, patched=True)


# -- a corrupt destination never runs -------------------------------------------------
def _completed_ends(**kw):
    src, dst = ends(**kw)
    dst.events.append({"event": "MIGRATION", "data": {"status": "completed"},
                       "timestamp": {"seconds": 1, "microseconds": 0}})
    dst.commands.add("blockdev-set-active")
    return src, dst


def test_ram_mismatch_fails_keeps_destination_paused_and_resumes_source():
    src, dst = _completed_ends()
    before_src = (dict(src.caps), dict(src.params))
    orig = dst.cmd

    async def corrupt_on_load(command, **args):  # the destination loaded a bad page
        if command == "x-query-ram-digest" and not dst.called("x-query-ram-digest"):
            dst.ram["pc.ram"][0x200010] ^= 0x40
        return await orig(command, **args)

    dst.cmd = corrupt_on_load  # type: ignore[method-assign]
    plan = Plan(URI, settings=(("downtime-limit", "500"), *FAST), profile="defaults")
    rec = run(Engine(src, dst, plan.validate()))
    assert rec.outcome == "failed"
    assert rec.ram is not None and rec.ram.result == "mismatch"
    assert "0x200000" in (rec.reason or "") and "in 1 page (first: 0x200000)" in (rec.reason or "")
    assert not dst.called("cont") and dst.status != "running"
    assert dst.called("blockdev-set-active") == [{"active": False}]
    assert src.called("cont") and src.status == "running"
    assert rec.source_after == {"running": True, "status": "running"}
    assert (src.caps, src.params) == before_src and dst.params["downtime-limit"] == 300
    assert rec.t_cont is None


def test_disk_mismatch_from_a_hook_fails_the_same_way():
    from livemig.engine.run import Hooks

    class DiskBad(Hooks):
        async def verify_more(self):
            return "destination disk differs from the source in 1 blocks (first: 0x1000)"

    src, dst = _completed_ends()
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate(),
                     hooks=DiskBad()))
    assert rec.outcome == "failed" and "disk differs" in (rec.reason or "")
    assert rec.ram is not None and rec.ram.result == "ok"
    assert not dst.called("cont") and src.status == "running"


def test_identical_ram_still_resumes_the_destination_not_the_source():
    src, dst = _completed_ends()
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "completed" and dst.status == "running"
    assert not src.called("cont") and not dst.called("blockdev-set-active")


def test_resume_corrupt_is_the_verify_inject_debug_path_only():
    src, dst = _completed_ends()
    dst.ram["pc.ram"][5] ^= 1
    plan = Plan(URI, settings=FAST, profile="defaults", resume_corrupt=True).validate()
    rec = run(Engine(src, dst, plan))
    assert rec.outcome == "completed" and rec.ram is not None and rec.ram.result == "mismatch"
    assert dst.status == "running"


def test_drill_down_is_capped_however_much_differs():
    from livemig.engine.verify import MAX_DRILLED, MAX_REPORTED

    src, dst = ends(ram_size=64 << 20)
    src.status = dst.status = "paused"
    for off in range(0, 64 << 20, 1 << 20):  # every 1 MiB chunk differs, 2 pages each
        dst.ram["pc.ram"][off] ^= 1
        dst.ram["pc.ram"][off + 0x5000] ^= 1
    v = asyncio.run(compare_digests(src, dst, chunk=1 << 20))
    drills = [a for a in src.called("x-query-ram-digest") if "block" in a]
    assert len(drills) == MAX_DRILLED
    assert v.mismatched_chunks == 64 and v.capped
    assert v.mismatched_pages == 2 * MAX_DRILLED
    assert len(v.first_mismatches) == MAX_REPORTED
    assert v.as_dict()["pages_counted_in_first_chunks"] == MAX_DRILLED
    from livemig.engine.run import mismatch_reason

    reason = mismatch_reason(v, None) or ""
    assert "or more" in reason and reason.count("0x") == 4 and reason.endswith(", ...)")


def test_guardian_told_of_a_corrupt_destination_resumes_the_source():
    from livemig.engine.guardian import REFUSE_DESTINATION

    src, dst = ends(statuses=["completed"])
    src.migrating = True
    src.status, dst.status = "postmigrate", "paused"
    dst.migrating, dst.statuses = True, ["completed"]
    spec = {**_spec(src, dst), REFUSE_DESTINATION: True}
    asyncio.run(repair_ends(src, dst, spec))
    assert not dst.called("cont") and dst.status == "paused"
    assert src.called("cont") and src.status == "running"


@pytest.mark.parametrize("outcome,ram,rc", [
    ("failed", "mismatch", 4), ("failed", "skipped", 1), ("completed", "mismatch", 4),
    ("completed", "ok", 0), ("aborted", "skipped", 3)])
def test_exit_status_says_a_mismatch_was_found_whatever_the_outcome(outcome, ram, rc):
    from livemig.cli import finish_run

    rep = {"outcome": outcome, "reason": "x", "consistency": {"ram": ram, "disk": "skipped"}}
    assert finish_run(rep, None, "") == rc


# -- stalls, timeouts, the split-brain guard ------------------------------------------
def test_stall_watch_cancels_only_when_nothing_moves_before_switchover():
    from livemig.engine.stall import StallWatch

    w = StallWatch(5.0)
    assert w.feed(0.0, "active", 100) is None
    assert w.feed(4.9, "active", 100) is None
    assert "no migration bytes moved for 5s" in (w.feed(5.0, "active", 100) or "")
    w = StallWatch(5.0)
    for t in range(20):  # bytes move every poll: never a stall
        assert w.feed(float(t), "active", 100 + t) is None
    assert w.feed(30.0, "active", 119, disk_remaining=5) is None  # the disk moved
    assert w.feed(31.0, "device", 119) is None and w.feed(99.0, "device", 119) is None
    assert StallWatch(0).feed(0.0, "active", 1) is None
    assert StallWatch(0).feed(1e6, "active", 1) is None  # off


def test_stalled_migration_is_cancelled_throttle_dropped_source_runs():
    src, dst = ends(statuses=["active"])
    src.commands.add("cancel-cpu-throttle")
    orig = src.cmd

    async def frozen(command, **args):  # the link is dead: transferred never moves
        return await orig(command, **args)

    src.cmd = frozen  # type: ignore[method-assign]
    plan = Plan(URI, settings=(*FAST, ("stall-timeout", "0.1")), profile="defaults")
    rec = run(Engine(src, dst, plan.validate()))
    assert rec.outcome == "aborted" and "stalled" in (rec.reason or "")
    names = [c for c, _ in src.log]
    assert "cancel-cpu-throttle" in names
    assert names.index("cancel-cpu-throttle") < names.index("migrate_cancel")
    assert src.status == "running" and not dst.called("cont")


def test_destination_that_never_finishes_loading_fails_and_source_resumes(monkeypatch):
    import livemig.engine.run as engine_run

    monkeypatch.setattr(engine_run, "DST_LOAD_TIMEOUT_S", 0.2)
    src, dst = ends()  # no MIGRATION completed event from the destination
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "failed" and "did not finish loading" in (rec.reason or "")
    assert dst.called("stop") and dst.autostart is False  # cannot start by itself later
    assert not dst.called("cont") and src.status == "running"


def test_last_bytes_lost_after_the_source_completed_fail_at_once_not_at_the_timeout(
        monkeypatch):
    """The link dies while the last bytes sit in the source's closed socket: no ACK
    comes for them, so the destination can never finish loading; the source (paused,
    intact) resumes after the stall timeout, not after the 60 s load timeout."""
    import time

    import livemig.engine.run as engine_run
    from livemig.engine.sockstat import LinkState
    from livemig.engine.stall import SwitchoverWatch

    monkeypatch.setattr(engine_run, "LOOK_S", 0.02)
    dead = SwitchoverWatch(0.1, lambda: LinkState(acked=5, pending=65536, last_ack_s=30.0))
    monkeypatch.setattr(Engine, "_switchover_watch", lambda self: dead)
    src, dst = ends()  # no MIGRATION completed event from the destination
    t0 = time.monotonic()
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert time.monotonic() - t0 < engine_run.DST_LOAD_TIMEOUT_S / 4
    assert rec.outcome == "failed" and "cannot finish loading" in (rec.reason or "")
    assert "65536 bytes waited" in (rec.reason or "")
    assert not dst.called("cont") and src.status == "running"


def test_split_brain_guard_keeps_the_source_paused_if_the_destination_runs(monkeypatch):
    import livemig.engine.run as engine_run

    monkeypatch.setattr(engine_run, "DST_LOAD_TIMEOUT_S", 0.2)
    src, dst = ends()
    orig = dst.cmd

    async def autostarted(command, **args):  # no -S: it started by itself
        if command == "query-status":
            dst.status = "running"
        return await orig(command, **args)

    dst.cmd = autostarted  # type: ignore[method-assign]
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults",
                                    verify=False).validate()))
    assert rec.outcome == "failed"
    assert not src.called("cont") and src.status == "postmigrate"
    assert rec.source_after is not None and "split-brain" in rec.source_after["error"]


def test_qmp_call_without_answer_is_a_vmerror_naming_the_command(monkeypatch):
    from livemig.engine import endpoint
    from livemig.errors import VMError

    class Silent:
        async def execute(self, command, args):
            await asyncio.sleep(10)

    monkeypatch.setitem(endpoint.SLOW_QMP_S, "query-status", 0.05)
    e = endpoint.Endpoint("src", "/nonexistent")
    e.qmp = Silent()  # type: ignore[assignment]
    with pytest.raises(VMError, match="query-status: no answer from QEMU within"):
        asyncio.run(e.cmd("query-status"))
    assert endpoint.qmp_timeout("x-query-ram-digest") > endpoint.qmp_timeout("query-migrate")


def test_guardian_split_brain_guard_leaves_the_source_paused_if_dst_runs():
    src, dst = ends(statuses=["failed"])
    src.migrating = True
    src.status, dst.status = "postmigrate", "running"  # dst had no -S and started
    done = asyncio.run(repair_ends(src, dst, _spec(src, dst)))
    assert not src.called("cont"), done
    assert any("split-brain" in a for a in done["actions"])


def test_guardian_starts_before_the_first_setting_is_changed(tmp_path, monkeypatch):
    from livemig.engine import guardian

    src, dst = _completed_ends()
    seen = []

    class Handle:
        def tell(self, word):
            pass

        def dismiss(self):
            seen.append("dismissed")

    def start(spec, directory):
        seen.append(("started", len(src.called("migrate-set-capabilities")),
                     len(src.called("migrate-set-parameters"))))
        return Handle()

    monkeypatch.setattr(guardian, "start", start)
    plan = Plan(URI, settings=(("downtime-limit", "500"), ("multifd", "on"), *FAST),
                profile="defaults").validate()
    rec = run(Engine(src, dst, plan, guardian_dir=tmp_path))
    assert rec.outcome == "completed"
    assert seen == [("started", 0, 0), "dismissed"]


def test_guardian_in_post_copy_leaves_the_source_and_still_restores():
    src, dst = ends(statuses=["postcopy-active"])
    spec = _spec(src, dst)
    src.migrating = True
    src.status = "postmigrate"
    dst.status = "running"
    dst.params["downtime-limit"] = 999
    done = asyncio.run(repair_ends(src, dst, spec))
    assert not src.called("cont") and not src.called("migrate_cancel")
    assert any("post-copy" in a for a in done["actions"])
    assert dst.params["downtime-limit"] == 300  # the restores ran


def test_guardian_restores_even_when_the_source_refuses_cont():
    src, dst = ends(statuses=["failed"])
    spec = _spec(src, dst)
    src.migrating = True
    src.status = "paused"
    src.params["downtime-limit"] = 999
    orig = src.cmd

    async def refuse(command, **args):
        if command == "cont":
            from livemig.errors import VMError
            raise VMError("src: cont: refused")
        return await orig(command, **args)

    src.cmd = refuse  # type: ignore[method-assign]
    done = asyncio.run(repair_ends(src, dst, spec))
    assert any("source cont failed" in a for a in done["actions"])
    assert src.params["downtime-limit"] == 300


# -- post-copy ------------------------------------------------------------------------
def _postcopy_ends(statuses: list[str]):
    src, dst = ends(statuses=statuses)
    for end in (src, dst):
        end.caps["postcopy-ram"] = False
    src.commands.add("migrate-start-postcopy")

    async def paced(timeout: float):  # polls a period apart, so that time passes
        await asyncio.sleep(timeout)
        return None
    src.next_event = paced  # type: ignore[method-assign]
    dst.events.append({"event": "MIGRATION", "data": {"status": "completed"},
                       "timestamp": {"seconds": 1, "microseconds": 0}})
    return src, dst


def test_postcopy_after_resumes_the_destination_as_soon_as_postcopy_began():
    src, dst = _postcopy_ends(["active", "active", "postcopy-active", "postcopy-active",
                               "completed"])
    plan = Plan(URI, settings=(("postcopy-after", "0.001"), *FAST),
                profile="defaults").validate()
    rec = run(Engine(src, dst, plan))
    assert rec.outcome == "completed", rec.reason
    assert src.called("migrate-start-postcopy")
    assert src.caps["postcopy-ram"] is False  # set for the run, put back
    names = [c for c, _ in src.log]
    # the destination ran while the source was still in post-copy, not at the end
    cont_at = dst.log.index(("cont", {}))
    assert cont_at >= 0 and names.count("query-migrate") >= 4
    assert rec.ram is not None and rec.ram.result == "skipped"
    assert "post-copy" in (rec.ram.why or "")
    assert not dst.called("x-query-ram-digest")  # nothing to compare: it ran already
    assert rec.verify_hold_ms == 0.0
    assert any(e.get("event") == "destination resumed in post-copy" for e in rec.events)


def test_in_postcopy_an_interrupt_neither_cancels_nor_resumes_the_source():
    src, dst = _postcopy_ends(["active", "active", "active", "postcopy-active",
                               "postcopy-active", "completed"])
    ev = asyncio.Event()
    plan = Plan(URI, settings=(("postcopy-after", "0.001"), *FAST),
                profile="defaults").validate()
    orig = src.cmd

    async def cmd(command, **args):
        if command == "migrate-start-postcopy":
            ev.set()  # Ctrl-C right after post-copy began
        return await orig(command, **args)

    src.cmd = cmd  # type: ignore[method-assign]
    rec = run(Engine(src, dst, plan, interrupt=ev))
    assert rec.outcome == "completed", rec.reason
    assert not src.called("migrate_cancel") and not src.called("cont")
    assert dst.status == "running"
    assert any(e.get("event") == "stop not possible in post-copy" for e in rec.events)


def test_a_postcopy_whose_link_failed_leaves_both_ends_as_they_are():
    src, dst = _postcopy_ends(["active", "active", "active", "postcopy-active",
                               "postcopy-paused"])
    plan = Plan(URI, settings=(("postcopy-after", "0.001"), *FAST),
                profile="defaults").validate()
    rec = run(Engine(src, dst, plan))
    assert rec.outcome == "failed" and "post-copy paused" in (rec.reason or "")
    # cancelling would lose the pages only the source has; resuming it, run it twice
    assert not src.called("migrate_cancel") and not src.called("cont")


def test_postcopy_after_needs_postcopy_ram():
    src, dst = ends()
    plan = Plan(URI, settings=(("postcopy-after", "5"), *FAST), profile="defaults").validate()
    with pytest.raises(UsageError, match="postcopy-after=5: this QEMU has no postcopy-ram"):
        run(Engine(src, dst, plan))


def test_a_postcopy_qemu_never_entered_leaves_the_runs_limits_in_force(monkeypatch):
    # migrate-start-postcopy answered but QEMU stays in pre-copy: after the grace
    # --max-time cancels again, the source keeps running
    monkeypatch.setattr("livemig.engine.monitor.POSTCOPY_GRACE_S", 0.05)
    src, dst = _postcopy_ends(["active"])
    plan = Plan(URI, settings=(("postcopy-after", "0.001"), *FAST), profile="defaults",
                max_time=0.2).validate()
    rec = run(Engine(src, dst, plan))
    assert src.called("migrate-start-postcopy")
    assert rec.outcome == "aborted" and "max-time" in (rec.reason or "")
    assert src.called("migrate_cancel") and src.status == "running"
    assert any(e.get("event") == "post-copy not entered" for e in rec.events)


# -- disk first: one monitor loop holds migrate until the caller's disk copy is ready --
class DiskFirst:
    """A caller that copies its disk before the RAM: the copy is ready after
    ``ready_after`` polls (never with None); records what the engine did and when."""

    def __init__(self, ready_after: int | None, at_poll=lambda polls: None) -> None:
        from livemig.engine.run import Hooks

        outer = self

        class _Hooks(Hooks):
            async def start_disk_copy(self):
                outer.started = True
                return True

            async def on_poll(self, now, obs):
                outer.polls += 1
                outer.statuses.append(obs.status)
                at_poll(outer.polls)
                return {"remaining_disk": outer.obs()["remaining"]}

            def disk_observation(self):
                return outer.obs() if outer.polls else None

            async def before_ram(self):
                outer.polls_at_migrate = outer.polls

            async def after_failure(self):
                outer.abandoned = True

        self.hooks = _Hooks()
        self.ready_after = ready_after
        self.started = self.abandoned = False
        self.polls = 0
        self.polls_at_migrate: int | None = None
        self.statuses: list[str] = []

    def obs(self) -> dict:
        left = 1 << 20 if self.ready_after is None else max(0, self.ready_after - self.polls)
        ready = self.ready_after is not None and self.polls >= self.ready_after
        return {"remaining": left << 16, "total": 64 << 20, "ready": ready}


def _bounded(engine: Engine):
    """A run that must end (a loop that never would fails the test, not the machine)."""
    return asyncio.run(asyncio.wait_for(engine.run(), 20))


def _snapshots(monkeypatch) -> list:
    """The snapshots the policy executor is ticked with."""
    from livemig.engine.executor import PolicyExecutor

    seen = []
    tick = PolicyExecutor.tick

    async def spy(self, s):
        seen.append(s)
        return await tick(self, s)

    monkeypatch.setattr(PolicyExecutor, "tick", spy)
    return seen


def test_disk_first_gate_holds_migrate_until_the_disk_is_ready(monkeypatch):
    src, dst = _completed_ends()
    real = src.cmd

    async def incoming_done(command, **args):  # a ping-pong source: it was migrated in
        if command == "query-migrate" and not src.migrating:
            return {"status": "completed"}
        return await real(command, **args)

    src.cmd = incoming_done  # type: ignore[method-assign]
    seen = _snapshots(monkeypatch)
    disk = DiskFirst(ready_after=4)
    plan = Plan(URI, settings=(("downtime-ramp", "on"), *FAST), profile="defaults")
    rec = _bounded(Engine(src, dst, plan.validate(), hooks=disk.hooks))
    assert rec.outcome == "completed", rec.reason
    # migrate was issued from the loop at the tick the disk said ready, not before
    assert disk.polls_at_migrate == 4 and len(src.called("migrate")) == 1
    names = [c for c, _ in src.log]
    # no query-migrate while the disk copied: the incoming "completed" is not this one
    assert "query-migrate" not in names[:names.index("migrate")]
    assert disk.statuses[:4] == ["disk-first"] * 4 and disk.statuses[4] != "disk-first"
    # the same timeline and policy tick: disk-only snapshots, remaining_disk sampled
    first = rec.timeline[:4]
    assert [s["status"] for s in first] == ["disk-first"] * 4
    assert [s["remaining_disk"] for s in first] == [3 << 16, 2 << 16, 1 << 16, 0]
    assert [(s.disk_remaining, s.disk_ready, s.ram_total) for s in seen[:4]] == [
        (3 << 16, False, 0), (2 << 16, False, 0), (1 << 16, False, 0), (0, True, 0)]
    assert rec.t_migrate is not None and rec.t_ram is not None and rec.t_ram > rec.t_migrate


@pytest.mark.parametrize("stop", ["max-time", "interrupt", "policy", "destination", "stall"])
def test_disk_first_stopped_before_migrate_leaves_the_source_running(stop, monkeypatch):
    from livemig.engine.decision import Verdict

    src, dst = ends()
    ev = asyncio.Event()

    def at_poll(polls: int) -> None:  # Ctrl-C, or the destination dies, at the 3rd poll
        if stop == "interrupt" and polls >= 3:
            ev.set()
        if stop == "destination" and polls >= 3:
            dst.dead = True

    disk = DiskFirst(ready_after=None, at_poll=at_poll)  # the first pass never ends
    max_time = 0.05 if stop == "max-time" else None
    sets: tuple = FAST
    if stop == "stall":  # the copy stands still (a dead link): the stall watchdog
        sets = (*FAST, ("stall-timeout", "0.1"))
    if stop == "policy":
        sets = (("downtime-ramp", "on"), *FAST)

        async def give_up(self, s):
            return Verdict(Decision.CANCEL, "io-qos gave up") if s.t > 0.03 else \
                Verdict(Decision.CONTINUE)

        monkeypatch.setattr("livemig.engine.executor.PolicyExecutor.tick", give_up)
    before = (dict(src.caps), dict(src.params))
    plan = Plan(URI, settings=sets, profile="defaults", max_time=max_time).validate()
    rec = _bounded(Engine(src, dst, plan, hooks=disk.hooks, interrupt=ev))
    want = {"max-time": ("aborted", "disk copy not done within --max-time 0.05s"),
            "interrupt": ("aborted", "interrupted"),
            "policy": ("aborted", "io-qos gave up"),
            "destination": ("failed", "destination QEMU is gone (dst)"),
            "stall": ("aborted", None)}[stop]
    if stop == "stall":
        assert rec.outcome == "aborted" and rec.reason.startswith("stalled"), rec.reason
    else:
        assert (rec.outcome, rec.reason) == want
    assert not src.called("migrate") and not src.called("migrate_cancel")
    assert disk.polls >= 2 and set(disk.statuses) == {"disk-first"}
    assert disk.abandoned  # the caller's copy is given up
    assert src.status == "running" and rec.source_after == {"running": True,
                                                            "status": "running"}
    assert (src.caps, src.params) == before and not dst.called("cont")
    assert rec.t_migrate is not None and rec.t_ram is None


def test_disk_first_then_a_cancel_in_the_ram_phase_gives_up_the_disk_copy():
    """The disk copied first, the RAM started, then --max-time cancelled the migration:
    the caller's copy is abandoned as on any other failure (a lab source kept for the
    next hop must not keep the mirror job), and the source runs."""
    src, dst = ends(statuses=["active"])
    disk = DiskFirst(ready_after=2)
    plan = Plan(URI, settings=FAST, profile="defaults", max_time=0.2).validate()
    rec = _bounded(Engine(src, dst, plan, hooks=disk.hooks))
    assert rec.outcome == "aborted" and "max-time" in (rec.reason or ""), rec.reason
    assert src.called("migrate") and src.called("migrate_cancel")
    assert disk.abandoned
    assert src.status == "running" and not dst.called("cont")



def _ordered(src, dst) -> list[str]:
    """One log of both ends' commands, in the order they were issued."""
    order: list[str] = []
    for name, end in (("src", src), ("dst", dst)):
        orig = end.cmd

        async def logged(command, _orig=orig, _name=name, **args):
            order.append(f"{_name} {command}")
            return await _orig(command, **args)

        end.cmd = logged  # type: ignore[method-assign]
    return order


def test_a_completed_run_releases_the_stopped_sources_throttle_after_the_resume():
    """The guest waits paused on the destination from its load to ``cont``: the
    source's throttle and caps (a stopped QEMU) are released after that, not before."""
    src, dst = _completed_ends()
    src.commands.add("cancel-cpu-throttle")
    order = _ordered(src, dst)
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "completed", rec.reason
    assert order.index("dst cont") < order.index("src cancel-cpu-throttle")


def test_a_refused_destination_releases_the_throttle_before_the_source_runs():
    src, dst = _completed_ends()
    src.commands.add("cancel-cpu-throttle")
    orig = dst.cmd

    async def corrupt_on_load(command, **args):
        if command == "x-query-ram-digest" and not dst.called("x-query-ram-digest"):
            dst.ram["pc.ram"][0x200010] ^= 0x40
        return await orig(command, **args)

    dst.cmd = corrupt_on_load  # type: ignore[method-assign]
    order = _ordered(src, dst)
    rec = run(Engine(src, dst, Plan(URI, settings=FAST, profile="defaults").validate()))
    assert rec.outcome == "failed" and src.status == "running"
    assert order.index("src cancel-cpu-throttle") < order.index("src cont")
    assert "dst cont" not in order
