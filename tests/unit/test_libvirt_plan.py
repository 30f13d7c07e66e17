"""livemig's profiles turned into libvirt flags, typed parameters and passthrough
(pure logic: no libvirt, no QEMU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from livemig.engine.executor import SWITCHOVER_BW
from livemig.engine.observe import POLICY_STATES, Observation
from livemig.errors import UsageError
from livemig.policy.base import Snapshot
from livemig.settings import merge
from livemig.virt import plan as P
from livemig.virt.stats import disk_observation, query_migrate

STOCK_CAPS = frozenset({"xbzrle", "auto-converge", "events", "postcopy-ram", "multifd",
                        "return-path", "pause-before-switchover", "zero-copy-send"})
STOCK_PARAMS = {"multifd-channels": 2, "multifd-compression": "none",
                "multifd-zstd-level": 1, "downtime-limit": 300, "max-bandwidth": 0,
                "xbzrle-cache-size": 64 << 20, "cpu-throttle-initial": 20,
                "cpu-throttle-increment": 10, "throttle-trigger-threshold": 50,
                "tls-creds": ""}
STOCK = P.QemuInfo(STOCK_CAPS, STOCK_PARAMS, frozenset({"migrate", "query-migrate"}))
PATCHED = P.QemuInfo(STOCK_CAPS, {**STOCK_PARAMS, "cpu-throttle-direct": 0,
                                  "cpu-throttle-lease-ms": 1000,
                                  "multifd-lz4-acceleration": 1},
                     frozenset({"migrate"}))
PATCHED_CMD = P.QemuInfo(STOCK_CAPS, PATCHED.parameters,
                         frozenset({"set-cpu-throttle", "cancel-cpu-throttle"}))


def plan_for(profile: str, sets: dict[str, str] | None = None, qemu: P.QemuInfo = STOCK,
             **req: object) -> P.Plan:
    sets = sets or {}
    return P.make_plan(merge(profile, sets), frozenset(sets), qemu, P.Request(**req))


def test_every_run_is_live_peer_to_peer_and_moves_the_definition() -> None:
    p = plan_for("defaults")
    assert {"live", "peer2peer", "persist_dest", "undefine_source",
            "abort_on_error"} <= set(p.flag_names())
    assert p.params == {} and p.src_qmp == {} and p.dst_globals == {}


def test_upstream_profile_multifd_zstd_goes_by_passthrough_and_dest_global() -> None:
    p = plan_for("upstream")
    assert p.flags & P.PARALLEL and p.flags & P.AUTO_CONVERGE
    assert p.params == {P.P_PARALLEL: 2}
    assert p.src_qmp == {"multifd-compression": "zstd", "multifd-zstd-level": 1}
    assert p.dst_globals == {"multifd-compression": "zstd"}


def test_xbzrle_profile_uses_libvirt_compression() -> None:
    p = plan_for("upstream-xbzrle")
    assert p.flags & P.COMPRESSED and not p.flags & P.PARALLEL
    assert p.params == {P.P_COMPRESSION: "xbzrle", P.P_XBZRLE_CACHE: 256 << 20}


def test_multifd_and_xbzrle_together_are_refused() -> None:
    with pytest.raises(UsageError, match="exclude"):
        plan_for("defaults", {"xbzrle": "on", "multifd": "on"})


def test_livemig_profile_on_stock_qemu_falls_back_to_auto_converge() -> None:
    p = plan_for("livemig")
    assert p.throttle == "auto-converge" and p.flags & P.AUTO_CONVERGE
    assert p.throttle_knob is None
    assert any("auto-converge instead" in n for n in p.notes)
    assert any("encoding=auto" in n for n in p.notes)
    assert p.downtime_ramp and p.max_downtime == 1000


@pytest.mark.parametrize("qemu,knob", [(PATCHED, "parameter"), (PATCHED_CMD, "command")])
def test_livemig_profile_on_patched_qemu_uses_the_direct_throttle(
        qemu: P.QemuInfo, knob: str) -> None:
    p = plan_for("livemig", qemu=qemu)
    assert p.throttle == "converge" and p.throttle_knob == knob
    assert not p.flags & P.AUTO_CONVERGE


def test_lz4_needs_the_patched_build() -> None:
    with pytest.raises(UsageError, match="patched"):
        plan_for("defaults", {"encoding": "lz4"})
    p = plan_for("defaults", {"encoding": "lz4"}, qemu=PATCHED)
    assert p.flags & P.PARALLEL and p.dst_globals == {"multifd-compression": "lz4"}


def test_lz4_delta_encoding_reaches_both_ends() -> None:
    """encoding=lz4-delta is lz4 multifd plus the delta cache, on the source by
    passthrough and on the destination as -global (it refuses delta packets without)."""
    delta = P.QemuInfo(STOCK_CAPS, {**PATCHED.parameters, P.DELTA_KEY: 0},
                       frozenset({"migrate"}))
    with pytest.raises(UsageError, match="lz4-delta needs the patched"):
        plan_for("defaults", {"encoding": "lz4-delta"}, qemu=PATCHED)  # no delta key
    with pytest.raises(UsageError, match="patched"):
        plan_for("defaults", {"encoding": "lz4-delta"})
    p = plan_for("defaults", {"encoding": "lz4-delta"}, qemu=delta)
    assert p.flags & P.PARALLEL
    assert p.src_qmp == {"multifd-compression": "lz4", P.DELTA_KEY: P.DELTA_CACHE}
    assert p.dst_globals == {"multifd-compression": "lz4", P.DELTA_KEY: str(P.DELTA_CACHE)}


def test_the_codec_switch_reaches_the_destination_libvirt_starts() -> None:
    """The engine's deferred encoding (adapt: the stream starts with lz4, its delta
    cache and the capability) on a domain: the source's capability by passthrough, the
    destination's by -global (libvirt starts that QEMU and sets its capabilities
    itself), and a stale one in the live XML is replaced, not doubled."""
    switch = P.QemuInfo(STOCK_CAPS | {P.SWITCH_CAP}, {**PATCHED.parameters, P.DELTA_KEY: 0},
                        frozenset({"migrate"}))
    p = plan_for("defaults", {"multifd-compression": "lz4", P.DELTA_KEY: "1024M",
                              "multifd-zstd-level": "1", P.SWITCH_CAP: "on"}, qemu=switch)
    assert p.src_caps == {P.SWITCH_CAP: True} and p.flags & P.PARALLEL
    assert p.src_qmp == {"multifd-compression": "lz4", P.DELTA_KEY: 1 << 30,
                         "multifd-zstd-level": 1}  # what a switch may change: put back
    assert p.dst_globals == {"multifd-compression": "lz4", P.DELTA_KEY: str(1 << 30),
                             P.SWITCH_CAP: "on"}
    xml = P.with_globals("<domain type='qemu'><name>x</name></domain>", p.dst_globals)
    assert xml.count(f"migration.{P.SWITCH_CAP}=on") == 1
    assert P.has_stream_globals(xml)
    again = P.with_globals(xml, {"multifd-compression": "zstd"})
    assert P.SWITCH_CAP not in again and "multifd-compression=zstd" in again


def test_bandwidth_downtime_and_auto_converge_parameters() -> None:
    p = plan_for("defaults", {"downtime-limit": "50", "cpu-throttle-initial": "30",
                              "auto-converge": "on", "max-bandwidth": "10M"},
                 bandwidth=3 * (1 << 20) + 1)
    assert p.downtime_ms == 50
    assert p.params[P.P_AC_INITIAL] == 30
    assert p.params[P.P_BANDWIDTH] == 4  # MiB/s, rounded up; --bandwidth wins
    assert p.flags & P.AUTO_CONVERGE


def test_libvirt_owned_and_unknown_settings_are_refused() -> None:
    with pytest.raises(UsageError, match="libvirt decides"):
        plan_for("defaults", {"return-path": "on"})
    with pytest.raises(UsageError, match="libvirt decides"):
        plan_for("defaults", {"tls-creds": "x"})
    with pytest.raises(UsageError, match="unknown setting"):
        plan_for("defaults", {"no-such-knob": "1"})
    with pytest.raises(UsageError, match="did you mean 'xbzrle'"):
        plan_for("defaults", {"xbzrl": "on"})


def test_stock_parameters_libvirt_lacks_go_to_the_source_by_passthrough() -> None:
    p = plan_for("defaults", {"throttle-trigger-threshold": "60"})
    assert p.src_qmp == {"throttle-trigger-threshold": 60} and p.dst_globals == {}


def test_storage_copy_verify_holds_the_destination_paused() -> None:
    p = plan_for("defaults", storage="copy", disks=("vda",))
    assert p.flags & P.NON_SHARED_DISK and p.flags & P.PAUSED
    assert p.params[P.P_MIGRATE_DISKS] == ["vda"]
    shared = plan_for("defaults", unsafe=True)
    assert shared.flags & P.UNSAFE and not shared.flags & P.PAUSED


def test_on_stall_postcopy_sets_the_postcopy_flag_and_its_bandwidth() -> None:
    p = plan_for("defaults", {"on-stall": "postcopy"}, bandwidth=8 << 20)
    assert p.flags & P.POSTCOPY
    assert p.params[P.P_BANDWIDTH_POSTCOPY] == 8 and p.params[P.P_BANDWIDTH] == 8


def test_destination_xml_gets_migration_globals() -> None:
    xml = "<domain type='qemu'>\n  <name>x</name>\n</domain>\n"
    out = P.with_globals(xml, {"multifd-compression": "zstd"})
    assert "xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'" in out
    assert "<qemu:arg value='migration.multifd-compression=zstd'/>" in out
    assert out.rstrip().endswith("</domain>")
    ns = ("<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
          "<qemu:commandline><qemu:arg value='-L'/></qemu:commandline></domain>")
    out2 = P.with_globals(ns, {"multifd-compression": "zstd"})
    assert out2.count("<qemu:commandline>") == 1 and out2.count("xmlns:qemu") == 1
    assert P.with_globals(xml, {}) == xml


def test_flag_values_match_the_binding() -> None:
    libvirt = pytest.importorskip("libvirt")
    for value, name in P.FLAG_NAMES.items():
        assert getattr(libvirt, f"VIR_MIGRATE_{name.upper()}") == value
    for ours, theirs in ((P.P_BANDWIDTH, "BANDWIDTH"), (P.P_COMPRESSION, "COMPRESSION"),
                         (P.P_XBZRLE_CACHE, "COMPRESSION_XBZRLE_CACHE"),
                         (P.P_PARALLEL, "PARALLEL_CONNECTIONS"),
                         (P.P_AC_INITIAL, "AUTO_CONVERGE_INITIAL"),
                         (P.P_AC_INCREMENT, "AUTO_CONVERGE_INCREMENT"),
                         (P.P_MIGRATE_DISKS, "MIGRATE_DISKS"), (P.P_URI, "URI"),
                         (P.P_BANDWIDTH_POSTCOPY, "BANDWIDTH_POSTCOPY")):
        assert getattr(libvirt, f"VIR_MIGRATE_PARAM_{theirs}") == ours


def _observed(t: float, stats: dict[str, Any], write_rate: float | None = None,
              ) -> tuple[Observation, Snapshot]:
    obs = Observation.parse(t, query_migrate(stats))
    return obs, obs.snapshot(disk_observation(stats, write_rate))


def test_job_stats_become_a_policy_snapshot_and_a_sample() -> None:
    stats = {"type": 2, "memory_total": 256 << 20, "memory_remaining": 100 << 20,
             "memory_processed": 50 << 20, "memory_dirty_rate": 1000,
             "memory_page_size": 4096, "memory_bps": 5 << 20, "memory_iteration": 3,
             "disk_total": 0, "disk_remaining": 0, "disk_processed": 0}
    obs, s = _observed(2.0, stats)
    assert s.rounds == 3 and s.remaining == 100 << 20 and s.dirty_rate == 4096000
    assert s.page_rate == 0.0  # libvirt passes no page rate on (see virt/stats.py)
    sample = obs.sample()
    assert sample["status"] == "active" and sample["eta_s"] == pytest.approx(20.0)
    assert _observed(0.1, {"type": 2})[0].status == "prepare"
    # all sent: libvirt's switchover and finish, where nothing is decided or watched
    done = {**stats, "memory_remaining": 0}
    assert _observed(3.0, done)[0].status == "device"
    # only the disks move yet: the policies tick (IO QoS), the RAM figures are 0
    disk = {"type": 2, "memory_total": 256 << 20, "memory_remaining": 256 << 20,
            "disk_total": 64 << 20, "disk_remaining": 60 << 20}
    assert _observed(1.0, disk)[0].status == "disk" in POLICY_STATES
    assert query_migrate(stats, postcopy=True)["status"] == "postcopy-active"
    assert query_migrate({**stats, "auto_converge_throttle": 30})[
        "cpu-throttle-percentage"] == 30
    assert query_migrate({**stats, "auto_converge_throttle": 30}, throttle_pct=70)[
        "cpu-throttle-percentage"] == 70  # livemig's own throttle when it set one


DIGEST = P.QemuInfo(STOCK_CAPS | {P.RAM_CHECK_CAP}, PATCHED.parameters,
                    PATCHED_CMD.commands)


def test_in_stream_ram_check_is_set_on_the_source_when_qemu_has_it() -> None:
    p = plan_for("defaults", qemu=DIGEST)
    assert p.ram_check and p.src_caps == {P.RAM_CHECK_CAP: True}
    assert p.dst_globals == {}  # the destination needs nothing: the section says it all
    assert p.as_dict()["ram_check"] == "in-stream digest"


@pytest.mark.parametrize(("qemu", "sets", "req", "why"), [
    (STOCK, {}, {}, "has no x-ram-digest-check"),
    (DIGEST, {}, {"verify": False}, "--no-verify"),
    (DIGEST, {"on-stall": "postcopy"}, {}, "post-copy"),
    (DIGEST, {P.RAM_CHECK_CAP: "off"}, {}, "=off"),
])
def test_in_stream_ram_check_off_says_why(qemu: P.QemuInfo, sets: dict[str, str],
                                          req: dict[str, object], why: str) -> None:
    p = plan_for("defaults", sets, qemu=qemu, **req)
    assert not p.ram_check and why in p.ram_check_why
    assert p.src_caps.get(P.RAM_CHECK_CAP) is not True
    assert p.as_dict()["ram_check"].startswith("off: ")


def test_in_stream_ram_check_that_would_not_fit_the_budget_is_off() -> None:
    """QEMU digests all of RAM, source then destination, inside the pause: ~0.1 s per
    GiB. A 16 GiB guest's check would not fit the default budget (max-downtime, 1 s);
    an 8 GiB one does; asked for with no limit, or set on explicitly, it is on."""
    big = dataclasses.replace(DIGEST, ram_bytes=16 << 30)
    p = plan_for("defaults", qemu=big)
    assert not p.ram_check and "would add ~1.6 s" in p.ram_check_why
    assert "1 s ram-check-budget" in p.ram_check_why
    assert plan_for("defaults", qemu=dataclasses.replace(DIGEST, ram_bytes=8 << 30)).ram_check
    assert plan_for("defaults", {"ram-check-budget": "0"}, qemu=big).ram_check
    assert plan_for("defaults", {"max-downtime": "2000"}, qemu=big).ram_check
    assert plan_for("defaults", {P.RAM_CHECK_CAP: "on"}, qemu=big).ram_check


def test_ram_fault_goes_to_the_destination_and_needs_the_check() -> None:
    p = plan_for("defaults", qemu=DIGEST, ram_fault=0x7c00)
    assert p.dst_globals == {P.RAM_CHECK_FAULT: str(0x7c00)}
    assert f"migration.{P.RAM_CHECK_FAULT}=31744" in P.with_globals(
        "<domain type='qemu'><name>x</name></domain>", p.dst_globals)
    with pytest.raises(UsageError, match="needs the in-stream RAM check"):
        plan_for("defaults", qemu=STOCK, ram_fault=0x7c00)


def test_ram_check_figures_and_mismatch_for_the_report() -> None:
    from livemig.virt.run import ram_check_failed, ram_check_ok

    ok = ram_check_ok({"blocks": 5, "size": 1 << 30, "chunk-size": 1 << 20,
                       "source-time": 50_000, "destination-time": 60_000})
    assert ok["result"] == "ok" and ok["method"].startswith("in-stream digest")
    assert ok["cost_s_per_gib"] == {"source": 0.05, "destination": 0.06}
    assert "threads" not in ok  # a build before patch 0017
    assert ram_check_ok({"blocks": 5, "size": 1 << 30, "chunk-size": 1 << 20,
                         "source-time": 1, "threads": 2})["threads"] == 2
    # libvirt 9.0's error when the destination QEMU fails the check (its log's tail)
    msg = ("internal error: qemu unexpectedly closed the monitor: 2026-11-23T13:15:07Z "
           "qemu-system-x86_64: load of migration failed: Invalid argument: error while "
           "loading state for instance 0x0 of device 'ram-digest-check': post load hook "
           "failed for: ram-digest-check, version_id: 1, minimum_version: 1: "
           "x-ram-digest-check: guest RAM differs from the source: RAM block 'pc.ram' "
           "bytes [0x0, 0x100000) are the first of 1 differing chunk(s) of 0x100000 "
           "bytes (mix64x4 digests of 6 blocks, 0x10082000 bytes)")
    bad = ram_check_failed(msg)
    assert bad["result"] == "mismatch"
    assert bad["detail"].startswith("x-ram-digest-check: guest RAM differs")
    assert "'pc.ram' bytes [0x0, 0x100000)" in bad["detail"]
    assert ram_check_failed("Connection reset")["result"] == "skipped"


def test_disk_check_is_planned_and_checked() -> None:
    copy = {"storage": "copy", "disks": ("vda",)}
    p = plan_for("defaults", {"disk-check": "stream"}, **copy)
    assert p.disk_check == "stream" and p.as_dict()["disk_check"] == "stream"
    assert p.flags & P.PAUSED  # the images are compared before the destination runs
    assert plan_for("defaults", **copy).disk_check == "auto"
    assert plan_for("defaults", {"disk-check": "nbd"}, **copy).disk_check == "nbd"
    with pytest.raises(UsageError, match=r"bad --set disk-check=ndb: .*auto.*nbd.*file"):
        plan_for("defaults", {"disk-check": "ndb"}, **copy)


# -- the whole profile under libvirt: drain, IO QoS, and what cannot apply --------------
DRAIN = P.QemuInfo(STOCK_CAPS | {"x-switchover-drain"}, PATCHED_CMD.parameters,
                   PATCHED_CMD.commands)


def test_drain_is_set_beside_return_path_on_the_source_only() -> None:
    p = plan_for("livemig", qemu=DRAIN)
    assert p.drain
    assert p.src_caps["x-switchover-drain"] is True and p.src_caps["return-path"] is True
    assert "x-switchover-drain" not in p.dst_globals  # the destination only answers PINGs
    assert not any("switchover-drain" in n for n in p.notes)


def test_drain_without_the_patch_is_said_or_refused() -> None:
    p = plan_for("livemig", qemu=PATCHED_CMD)
    assert not p.drain and "x-switchover-drain" not in p.src_caps
    assert any(n.startswith("switchover-drain not applied: the domain's QEMU has no")
               for n in p.notes)
    with pytest.raises(UsageError, match="switchover-drain=on needs the patched QEMU"):
        plan_for("livemig", {"switchover-drain": "on"}, qemu=PATCHED_CMD)
    assert not plan_for("livemig", {"switchover-drain": "off"}, qemu=DRAIN).drain


def test_switchover_bandwidth_where_the_qemu_has_the_parameter() -> None:
    new = P.QemuInfo(STOCK_CAPS, {**STOCK_PARAMS, SWITCHOVER_BW: 0}, STOCK.commands)
    p = plan_for("livemig", qemu=new)
    assert p.switchover_bandwidth and p.as_dict()["switchover_bandwidth"]
    assert SWITCHOVER_BW not in p.src_qmp  # set by the executor, after the first pass
    old = plan_for("livemig", qemu=STOCK)  # a QEMU before 8.2
    assert not old.switchover_bandwidth
    assert any(n.startswith("switchover-bandwidth not applied") for n in old.notes)
    assert not plan_for("upstream", qemu=new).switchover_bandwidth
    # the user's own value is passed through and left alone
    mine = plan_for("livemig", {SWITCHOVER_BW: "1000000"}, qemu=new)
    assert not mine.switchover_bandwidth and mine.src_qmp[SWITCHOVER_BW] == 1000000


def test_io_qos_with_copied_storage_and_said_without() -> None:
    p = plan_for("livemig", qemu=DRAIN, storage="copy", disks=("vda",))
    assert p.io_qos and p.as_dict()["io_qos"]
    assert not any(n.startswith("io-qos") for n in p.notes)
    # the disk copy is libvirt's: the link share and the mirror's knobs are said
    for key in ("disk-schedule", "disk-granularity", "disk-copy-mode"):
        assert any(n.startswith(f"{key} not applied: libvirt") for n in p.notes), key
    p = plan_for("livemig", qemu=DRAIN)
    assert not p.io_qos
    assert "io-qos not applied: no disk is copied (--storage shared)" in p.notes
    assert "disk-schedule not applied: no disk is copied (--storage shared)" in p.notes


def test_pin_is_said_with_why_never_silently() -> None:
    p = plan_for("livemig", qemu=DRAIN)
    assert any(n.startswith("pin not applied: libvirt 9.0 takes a modify job") for n in p.notes)
    # the defaults ask for nothing libvirt cannot do: nothing to say
    assert plan_for("defaults", qemu=DRAIN).notes == ()


def test_lab_settings_given_explicitly_are_said() -> None:
    p = plan_for("defaults", {"warmup": "5", "client-stream": "udp"})
    assert any(n.startswith("warmup not applied: a lab-run setting") for n in p.notes)
    assert any(n.startswith("client-stream not applied") for n in p.notes)


def test_disk_write_rate_reaches_the_snapshot() -> None:
    _, s = _observed(1.0, {"disk_remaining": 5 << 20, "disk_total": 64 << 20}, 3e6)
    assert s.disk_write_rate == 3e6 and s.disk_remaining == 5 << 20


def test_no_disk_remainder_before_libvirt_starts_the_copy() -> None:
    assert _observed(0.5, {"disk_remaining": 0, "disk_total": 0}, 3e6)[1].disk_remaining \
        is None
    assert _observed(0.5, {})[1].disk_remaining is None


def test_stream_globals_left_by_an_earlier_migration_are_replaced():
    from livemig.virt.plan import has_stream_globals, with_globals

    xml = ("<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
           "<name>a</name><qemu:commandline>\n"
           "  <qemu:arg value=\"-global\"/>\n"
           "  <qemu:arg value=\"migration.x-multifd-lz4-delta-cache-size=134217728\"/>\n"
           "  <qemu:arg value='-L'/><qemu:arg value='/usr/share/seabios'/>\n"
           "</qemu:commandline></domain>")
    assert has_stream_globals(xml)
    out = with_globals(xml, {"multifd-compression": "lz4"})
    assert "lz4-delta-cache-size" not in out and not has_stream_globals(
        out.replace("multifd-compression=lz4", "x"))
    assert "migration.multifd-compression=lz4" in out and "/usr/share/seabios" in out
    bare = with_globals(xml, {})
    assert not has_stream_globals(bare) and "/usr/share/seabios" in bare


def test_postcopy_after_asks_libvirt_for_postcopy() -> None:
    p = plan_for("defaults", {"postcopy-after": "20"})
    assert p.flags & P.POSTCOPY and p.postcopy_after == 20.0
    assert not plan_for("defaults").flags & P.POSTCOPY


# -- a destination host whose QEMU is not the patched build ---------------------------
FULL = P.QemuInfo(STOCK_CAPS | {P.SWITCH_CAP, P.DRAIN_CAP, P.RAM_CHECK_CAP},
                  {**PATCHED.parameters, P.DELTA_KEY: 0},
                  frozenset({"set-cpu-throttle", "cancel-cpu-throttle"}))


def test_the_refused_global_of_a_stock_destination_is_recognised() -> None:
    """libvirt's error when the destination QEMU refuses a -global at its start (the
    text of the testbed's stock destination)."""
    reason = ("internal error: qemu unexpectedly closed the monitor: 2026-11-30T19:07:15Z "
              "qemu-system-x86_64: can't apply global migration.x-multifd-compression-"
              "switch=on: Property 'migration.x-multifd-compression-switch' not found")
    assert P.refused_global(reason) == P.SWITCH_CAP
    assert P.refused_global("Unsafe migration: Migration without shared storage") is None
    assert P.refused_global(None) is None
    # no -global to refuse (an idle guest's plan has no codec switch): the in-stream
    # RAM check's section is what it cannot load, at the end of the stream
    late = ("internal error: qemu unexpectedly closed the monitor: 2026-12-01T00:10:15Z "
            "qemu-system-x86_64: load of migration failed: Invalid argument: Unknown "
            "section or instance 'ram-digest-check' 0. Make sure that your current VM "
            "setup matches your saved VM setup, including any hotplugged devices")
    assert P.refused_global(late) == P.RAM_CHECK_CAP
    # a device the destination lacks is not the build: no retry for it
    assert P.refused_global(late.replace("ram-digest-check", "virtio-net")) is None


def test_toward_a_stock_destination_the_plan_keeps_the_sources_own_mechanisms() -> None:
    wanted = {**merge("livemig", {}), "multifd-compression": "zstd", "encoding": "off"}
    both = P.make_plan(wanted, frozenset(), FULL, P.Request())
    assert both.drain and both.ram_check
    stock = P.make_plan(wanted, frozenset(), FULL.for_stock_peer(), P.Request())
    # nothing the destination's QEMU would refuse or could not read
    assert not stock.drain and not stock.ram_check
    assert set(stock.dst_globals) <= {"multifd-compression"}
    assert not set(stock.src_caps) & P.PEER_CAPS
    assert "the destination's QEMU has no" in stock.ram_check_why
    # the source's direct throttle needs nothing of the destination: it stays
    assert stock.throttle_knob == "command" and stock.throttle == "converge"
