"""livemig's profile and ``--set`` overrides, turned into what libvirt takes.

Pure: no I/O, so every mapping is unit-tested. What libvirt has a name for goes
through libvirt (flags and typed migration parameters of ``virDomainMigrateToURI3``,
``migrateSetMaxDowntime`` once the job runs), because libvirt sets migration
capabilities and parameters on *both* QEMUs and resets them afterwards. What libvirt
(9.0, bookworm's) has no name for goes through the QMP passthrough on the source:

- ``multifd-compression`` (libvirt 9.0 knows only ``mt``, the compression QEMU 9.1
  removed, and ``xbzrle``; ``zlib``/``zstd`` came in libvirt 9.4, ``lz4`` is
  livemig's patch): set on the source by passthrough, and on the destination with
  ``-global migration.multifd-compression=...`` in the destination's live XML
  (``VIR_MIGRATE_PARAM_DEST_XML``), since the destination QEMU is started by the
  other daemon and must decode the same method. The persistent definition on the
  destination stays the user's;
- the in-stream RAM check (patch 0006, capability ``x-ram-digest-check``): on the
  source only, by passthrough; the source sends its RAM digests at switchover and the
  destination fails the migration on a mismatch, so libvirt resumes the source. On
  by default when the source QEMU has it and ``--no-verify`` was not given;
- the patched QEMU's knobs (``cpu-throttle-direct`` / ``set-cpu-throttle``,
  ``multifd-lz4-*``, ``hot-page-*``) and any other stock parameter libvirt does not
  manage (e.g. ``throttle-trigger-threshold``, ``announce-*``): passthrough on the
  source, restored by livemig if the source keeps running.

Capabilities libvirt manages itself (``events``, ``return-path``,
``pause-before-switchover``, ``late-block-activate``, ``dirty-bitmaps``, ...) are
refused: libvirt would overwrite them.

The switchover drain (patch 0007, ``x-switchover-drain``) needs ``return-path``, which
libvirt 9.0 turns on itself for every migration that is not tunnelled
(``qemu_migration_params.c``: return-path is "forbidden" only with
``VIR_MIGRATE_TUNNELLED``; livemig never tunnels). QEMU checks the pair when the
capability is set, so livemig sets both on the source by passthrough before the
migration; the destination needs neither (it only answers the source's PING). But
libvirt's reset after a failed or aborted migration turns every capability it knows
off in one command, and QEMU refuses to drop return-path while the drain is on: the
reset fails as a whole (measured: multifd, pause-before-switchover and the bandwidth
stay as the migration set them). So with the drain, livemig restores on a source that
keeps running what libvirt's reset would have: the capabilities and parameters
libvirt manages (:data:`LIBVIRT_RESET_CAPS`, :data:`LIBVIRT_RESET_PARAMS`) as they
were before the migration.

``io-qos`` (with ``--storage copy``) is carried out by the policy executor through the
libvirt actuator (``virt/actuator.py``: ``block_set_io_throttle`` by passthrough, since
libvirt refuses ``setBlockIoTune`` beside a migration). What cannot apply under
libvirt is in the plan's ``notes`` (the report's events), with why: never silently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from livemig.engine.executor import SWITCHOVER_BW
from livemig.errors import UsageError
from livemig.settings import (
    DRAIN_CAP,
    DRAIN_NEEDS,
    LIVEMIG_SETTINGS,
    SWITCH_CAP,
    _convert_param,
    did_you_mean,
    postcopy_planned,
    ram_check_budget_s,
)

# libvirt's flag and parameter names (values from libvirt-domain.h; the binding is
# not imported here so that this module stays pure and testable without libvirt)
LIVE = 1 << 0
PEER2PEER = 1 << 1
PERSIST_DEST = 1 << 3
UNDEFINE_SOURCE = 1 << 4
PAUSED = 1 << 5
NON_SHARED_DISK = 1 << 6
UNSAFE = 1 << 9
COMPRESSED = 1 << 11
ABORT_ON_ERROR = 1 << 12
AUTO_CONVERGE = 1 << 13
POSTCOPY = 1 << 15
TLS = 1 << 16
PARALLEL = 1 << 17
ZEROCOPY = 1 << 20

FLAG_NAMES = {LIVE: "live", PEER2PEER: "peer2peer", PERSIST_DEST: "persist_dest",
              UNDEFINE_SOURCE: "undefine_source", PAUSED: "paused",
              NON_SHARED_DISK: "non_shared_disk", UNSAFE: "unsafe",
              COMPRESSED: "compressed", ABORT_ON_ERROR: "abort_on_error",
              AUTO_CONVERGE: "auto_converge", POSTCOPY: "postcopy",
              TLS: "tls", PARALLEL: "parallel", ZEROCOPY: "zerocopy"}

P_BANDWIDTH = "bandwidth"  # MiB/s
P_BANDWIDTH_POSTCOPY = "bandwidth.postcopy"  # MiB/s too
P_COMPRESSION = "compression"
P_XBZRLE_CACHE = "compression.xbzrle.cache"
P_PARALLEL = "parallel.connections"
P_AC_INITIAL = "auto_converge.initial"
P_AC_INCREMENT = "auto_converge.increment"
P_MIGRATE_DISKS = "migrate_disks"
P_URI = "migrate_uri"
P_TLS_DESTINATION = "tls.destination"  # the name the destination's certificate must have

# capabilities libvirt decides itself on both ends (it would overwrite ours)
LIBVIRT_OWNED_CAPS = frozenset({
    "events", "return-path", "pause-before-switchover", "late-block-activate",
    "dirty-bitmaps", "x-colo", "rdma-pin-all", "release-ram", "validate-uuid",
    "background-snapshot", "mapped-ram", "x-ignore-shared", "switchover-ack",
    "postcopy-preempt", "postcopy-blocktime", "zero-blocks",
})
LIBVIRT_OWNED_PARAMS = frozenset({
    "tls-creds", "tls-hostname", "tls-authz", "max-postcopy-bandwidth", "mode",
    "block-incremental",
})
# parameters the destination must share because they change the stream's encoding
# (the patched lz4 delta encoding: the destination refuses delta packets unless its
# own cache size is set too, "set x-multifd-lz4-delta-cache-size on the destination")
DELTA_KEY = "x-multifd-lz4-delta-cache-size"  # patched: lz4 multifd delta encoding
STREAM_PARAMS = frozenset({"multifd-compression", DELTA_KEY})
# encoding=lz4-delta's delta cache, as policy.encoding.ENCODINGS sets it for a lab run
DELTA_CACHE = 256 << 20
# patched QEMU (qemu/patches): the direct throttle, as a command or as a parameter
THROTTLE_COMMAND = "set-cpu-throttle"
THROTTLE_CANCEL = "cancel-cpu-throttle"
THROTTLE_PARAM = "cpu-throttle-direct"
LEASE_PARAM = "cpu-throttle-lease-ms"
LZ4_MARK = "multifd-lz4-acceleration"  # present in the patched build only
# patched QEMU (0006): the in-stream RAM check, and its testing-only fault (a byte of
# the destination's first RAM block flipped before it compares)
RAM_CHECK_CAP = "x-ram-digest-check"
RAM_CHECK_FAULT = "x-ram-digest-check-fault"
# the in-stream check's pause per GiB of guest RAM: both ends digest it in turn at ~0.05
# s per GiB each on a quiet host (patch 0006's measurement; 0.13-0.16 s each with both
# ends on one busy 2-core host)
IN_STREAM_S_PER_GIB = 0.1
# the patched build's mechanisms in the stream itself: the destination QEMU libvirt
# starts must have them too (a stock one refuses their -global, or the stream)
PEER_CAPS = frozenset({SWITCH_CAP, DRAIN_CAP, RAM_CHECK_CAP})
PEER_PARAMS = frozenset({LZ4_MARK, DELTA_KEY})
# set by ``livemig evacuate`` for a ``migrate --domain`` child whose destination it
# knows lacks them (the doctor's probe of its emulator, or an earlier VM's retry
# toward it): the value says how it knows, and the child starts as its retry would
STOCK_PEER_ENV = "LIVEMIG_STOCK_DESTINATION"
# ... and a file such a child writes the refused property to as soon as its first
# attempt was refused, so that the evacuation tells the children it starts meanwhile
STOCK_FOUND_ENV = "LIVEMIG_STOCK_FOUND"
# set by ``livemig evacuate`` for its children: how many migrations may run at once from
# the source host. Each child's delta cache (xbzrle's on a stock QEMU) takes its share
# of the quarter of the host's free memory one migration may use
# (:func:`livemig.policy.encoding.delta_cache`), so that together they stay within it
MIGRATIONS_AT_ONCE_ENV = "LIVEMIG_MIGRATIONS_AT_ONCE"


def lacks_peer_mechanisms(capabilities: frozenset[str], parameters: frozenset[str]
                          ) -> list[str]:
    """Which of :data:`PEER_CAPS` and :data:`PEER_PARAMS` a QEMU with these migration
    capabilities and parameters lacks (empty: it can receive all of them)."""
    return sorted((PEER_CAPS - capabilities) | (PEER_PARAMS - parameters))


# what a stock destination QEMU refusing one of them at its start says (libvirt's
# error quotes QEMU's): "can't apply global migration.K=V: Property '...' not found"
_REFUSED_GLOBAL = re.compile(r"can't apply global migration\.([\w-]+)=")
# ... and what it says at the end of the stream when the source sent the in-stream RAM
# check's section (patch 0006) and no -global made it refuse at its start (a plan
# without the codec switch: an idle guest's): "Unknown section or instance
# 'ram-digest-check' 0" (the source keeps running: libvirt resumes it)
_UNKNOWN_SECTIONS = {"ram-digest-check": RAM_CHECK_CAP}
_UNKNOWN_SECTION = re.compile(r"Unknown section or instance '([\w-]+)'")


def refused_global(reason: str | None) -> str | None:
    """The migration property a destination QEMU refused (at its start, or the
    section of one at the end of the stream), if that is why ``reason`` (a failed
    libvirt migration's) failed: it lacks livemig's build."""
    m = _REFUSED_GLOBAL.search(reason or "")
    if m:
        return m.group(1)
    m = _UNKNOWN_SECTION.search(reason or "")
    return _UNKNOWN_SECTIONS.get(m.group(1)) if m else None


# livemig settings a libvirt run cannot carry out, and why (said in the report's
# events whenever the profile or --set asks for more than the default)
NOT_UNDER_LIBVIRT = {
    "pin": "libvirt 9.0 takes a modify job for pinEmulator/pinVcpu, which it does not "
           "allow beside a migration (the call waits 30 s for the state change lock and "
           "fails), and a live pinning set before the migration would travel to the "
           "destination host in the migratable XML",
    "disk-schedule": "libvirt drives the disk copy (its NBD mirror) and its speed itself",
    "disk-speed": "libvirt drives the disk copy (its NBD mirror) and its speed itself",
    "disk-granularity": "libvirt creates the NBD mirror with its own granularity",
    "disk-copy-mode": "libvirt creates the NBD mirror with its own copy mode",
    "warmup": "a lab-run setting (livemig does not start the guest's workload)",
    "settle": "a lab-run setting (livemig does not observe the guest afterwards)",
    "client-stream": "a lab-run setting (the testbed's client stream)",
}
DISK_COPY_SETTINGS = ("io-qos", "disk-schedule", "disk-speed", "disk-granularity",
                      "disk-copy-mode")
# what libvirt 9.0 resets after a migration (its qemuMigrationCapability and
# qemuMigrationParam enums; "events" it keeps on): restored by livemig when the drain
# made libvirt's reset fail
LIBVIRT_RESET_CAPS = frozenset({
    "xbzrle", "auto-converge", "rdma-pin-all", "postcopy-ram", "compress",
    "pause-before-switchover", "late-block-activate", "multifd", "dirty-bitmaps",
    "return-path", "zero-copy-send",
})
LIBVIRT_RESET_PARAMS = frozenset({
    "compress-level", "compress-threads", "decompress-threads", "cpu-throttle-initial",
    "cpu-throttle-increment", "tls-creds", "tls-hostname", "max-bandwidth",
    "downtime-limit", "block-incremental", "xbzrle-cache-size", "max-postcopy-bandwidth",
    "multifd-channels", "multifd-compression", "multifd-zlib-level", "multifd-zstd-level",
})
POLICY_THROTTLES = ("reference", "direct", "staged", "converge")


@dataclass(frozen=True)
class QemuInfo:
    """What the source QEMU offers (from the passthrough before the migration)."""

    capabilities: frozenset[str]
    parameters: Mapping[str, Any]
    commands: frozenset[str]
    ram_bytes: int | None = None  # the guest's RAM (query-memory-size-summary)
    # whose lack the notes name: the destination's, toward a stock one (for_stock_peer)
    who: str = "the domain's QEMU"

    @property
    def throttle_knob(self) -> str | None:
        if THROTTLE_COMMAND in self.commands:
            return "command"
        if THROTTLE_PARAM in self.parameters:
            return "parameter"
        return None

    @property
    def peer_mechanisms(self) -> bool:
        """It has one of the stream mechanisms the destination must have too."""
        return bool(self.capabilities & PEER_CAPS or PEER_PARAMS & set(self.parameters))

    def for_stock_peer(self) -> QemuInfo:
        """What the source offers toward a destination QEMU without the patched
        build's stream mechanisms (:data:`PEER_CAPS`, :data:`PEER_PARAMS`); its own
        throttle, sampler and digest need nothing of the destination and stay."""
        return QemuInfo(self.capabilities - PEER_CAPS,
                        {k: v for k, v in self.parameters.items() if k not in PEER_PARAMS},
                        self.commands, self.ram_bytes, "the destination's QEMU")


@dataclass(frozen=True)
class Request:
    """What the user asked for, besides the profile."""

    storage: str = "shared"  # shared | copy
    disks: tuple[str, ...] = ()  # target names (vda, ...) to copy with --storage copy
    bandwidth: int | None = None  # bytes/s
    unsafe: bool = False
    verify: bool = True
    migrate_uri: str | None = None  # where the data goes (default: libvirt's choice)
    ram_fault: int | None = None  # debug: the destination flips this byte before the check
    tls: bool = False  # VIR_MIGRATE_TLS: the stream and the NBD disk copy over TLS
    tls_destination: str | None = None  # the destination's name in its certificate


@dataclass(frozen=True)
class Plan:
    flags: int
    params: dict[str, Any]
    src_qmp: dict[str, Any]  # migrate-set-parameters on the source (passthrough)
    src_caps: dict[str, bool]  # migrate-set-capabilities on the source (passthrough)
    dst_globals: dict[str, str]  # -global migration.KEY=VALUE on the destination
    downtime_ms: int | None
    throttle: str  # off | auto-converge | reference | direct | staged
    throttle_knob: str | None  # command | parameter (when throttle is a policy)
    downtime_ramp: bool
    max_downtime: int
    on_stall: str
    postcopy_after: float
    poll_interval: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    stall_timeout: float = 0.0  # the engine's stall watchdog (0: off)
    ram_check: bool = False  # the source sends RAM digests; the destination compares
    ram_check_why: str = ""  # why not, when it is off
    disk_check: str = "auto"  # auto | nbd | file | stream (copied disks, --storage copy)
    io_qos: bool = False  # cap guest writes to the copied disks while the copy lags
    drain: bool = False  # x-switchover-drain (and return-path) set on the source
    # the executor sets avail-switchover-bandwidth after the first pass (passthrough)
    switchover_bandwidth: bool = False

    def flag_names(self) -> list[str]:
        return [n for f, n in FLAG_NAMES.items() if self.flags & f]

    def as_dict(self) -> dict[str, Any]:
        return {"flags": self.flag_names(), "params": dict(self.params),
                "source_passthrough": {"parameters": dict(self.src_qmp),
                                       "capabilities": dict(self.src_caps)},
                "destination_globals": dict(self.dst_globals),
                "downtime_ms": self.downtime_ms, "throttle": self.throttle,
                "throttle_knob": self.throttle_knob, "downtime_ramp": self.downtime_ramp,
                "max_downtime": self.max_downtime, "on_stall": self.on_stall,
                "postcopy_after": self.postcopy_after,
                "poll_interval": self.poll_interval, "notes": list(self.notes),
                "stall_timeout": self.stall_timeout,
                "ram_check": ("in-stream digest" if self.ram_check
                              else f"off: {self.ram_check_why}"),
                "disk_check": self.disk_check, "io_qos": self.io_qos,
                "switchover_bandwidth": self.switchover_bandwidth,
                "switchover_drain": self.drain}


def _onoff(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise UsageError(f"bad --set {key}={value}: expected on or off")


def make_plan(wanted: Mapping[str, str], explicit: frozenset[str], qemu: QemuInfo,
              req: Request) -> Plan:
    """Everything decided before the migration starts; UsageError on what cannot be."""
    flags = LIVE | PEER2PEER | PERSIST_DEST | UNDEFINE_SOURCE | ABORT_ON_ERROR
    params: dict[str, Any] = {}
    src_qmp: dict[str, Any] = {}
    src_caps: dict[str, bool] = {}
    notes: list[str] = []
    lm: dict[str, Any] = {k: s.default for k, s in LIVEMIG_SETTINGS.items()}
    downtime: int | None = None

    for key, value in wanted.items():
        if key in LIVEMIG_SETTINGS:
            try:
                lm[key] = LIVEMIG_SETTINGS[key].kind(value)
            except (ValueError, UsageError):
                raise UsageError(f"bad --set {key}={value}: "
                                 f"{LIVEMIG_SETTINGS[key].doc}") from None
            continue
        if key in qemu.capabilities:
            on = _onoff(key, value)
            if key in LIBVIRT_OWNED_CAPS:
                raise UsageError(f"--set {key}: libvirt decides this capability itself")
            if key == "multifd":
                flags = flags | PARALLEL if on else flags & ~PARALLEL
            elif key == "xbzrle":
                if on:
                    flags |= COMPRESSED
                    params[P_COMPRESSION] = "xbzrle"
            elif key == "auto-converge":
                flags = flags | AUTO_CONVERGE if on else flags & ~AUTO_CONVERGE
            elif key == "postcopy-ram":
                flags = flags | POSTCOPY if on else flags & ~POSTCOPY
            elif key == "zero-copy-send":
                flags = flags | ZEROCOPY if on else flags & ~ZEROCOPY
            else:  # a capability libvirt does not know (e.g. a patched one)
                src_caps[key] = on
            continue
        if key in qemu.parameters:
            if key in LIBVIRT_OWNED_PARAMS:
                raise UsageError(f"--set {key}: libvirt decides this parameter itself")
            v = _convert_param(key, value, qemu.parameters[key])
            if key == "multifd-channels":
                params[P_PARALLEL] = int(v)
            elif key == "xbzrle-cache-size":
                params[P_XBZRLE_CACHE] = int(v)
            elif key == "cpu-throttle-initial":
                params[P_AC_INITIAL] = int(v)
            elif key == "cpu-throttle-increment":
                params[P_AC_INCREMENT] = int(v)
            elif key == "max-bandwidth":
                params[P_BANDWIDTH] = mib(int(v))
            elif key == "downtime-limit":
                downtime = int(v)
            else:
                src_qmp[key] = v
            continue
        hint = did_you_mean(key, [*qemu.capabilities, *qemu.parameters])
        raise UsageError(f"unknown setting {key!r}: not a livemig setting, nor a migration "
                         "capability or parameter of the domain's QEMU (is it the patched "
                         f"build?){hint}")

    # livemig settings that libvirt can carry out
    encoding = str(lm["encoding"])
    if encoding == "auto":
        notes.append("encoding=auto not applied: it samples the guest's RAM through the "
                     "lab's shared RAM file, which a libvirt domain does not have")
    elif encoding == "xbzrle" and "xbzrle" not in explicit:
        flags = (flags | COMPRESSED) & ~PARALLEL
        params[P_COMPRESSION] = "xbzrle"
    elif encoding in ("zstd", "lz4", "lz4-delta", "plain"):
        flags |= PARALLEL
        if encoding == "zstd":
            src_qmp.setdefault("multifd-compression", "zstd")
        if encoding in ("lz4", "lz4-delta"):
            if LZ4_MARK not in qemu.parameters:
                raise UsageError(f"encoding={encoding} needs the patched QEMU (multifd "
                                 "lz4); the domain's emulator lacks it")
            src_qmp.setdefault("multifd-compression", "lz4")
        if encoding == "lz4-delta":
            if DELTA_KEY not in qemu.parameters:
                raise UsageError(f"encoding=lz4-delta needs the patched QEMU's {DELTA_KEY}; "
                                 "the domain's emulator lacks it")
            # the cache the lab's encoding table gives it; a stream parameter, so the
            # destination gets it too (dst_globals)
            src_qmp.setdefault(DELTA_KEY, DELTA_CACHE)
    if src_qmp.get("multifd-compression", "none") != "none":
        flags |= PARALLEL
    if flags & PARALLEL and flags & COMPRESSED:
        raise UsageError("multifd (parallel connections) and xbzrle exclude each other "
                         "in QEMU: choose one")
    throttle = str(lm["throttle"])
    knob = qemu.throttle_knob if throttle in POLICY_THROTTLES else None
    if throttle in POLICY_THROTTLES and knob is None:
        notes.append(f"throttle={throttle} needs the patched QEMU's direct throttle "
                     f"({THROTTLE_COMMAND} or {THROTTLE_PARAM}); the domain's emulator "
                     "lacks it: libvirt's auto-converge instead")
        throttle = "auto-converge"
    if throttle == "auto-converge":
        flags |= AUTO_CONVERGE
    elif throttle == "dirty-limit":
        raise UsageError("throttle=dirty-limit: libvirt 9.0 has no dirty-limit migration "
                         "flag (and it needs KVM with a dirty ring)")
    on_stall = str(lm["on-stall"])
    if postcopy_planned(lm):
        flags |= POSTCOPY
    for key, why in NOT_UNDER_LIBVIRT.items():
        if lm[key] == LIVEMIG_SETTINGS[key].default:
            continue
        if key in DISK_COPY_SETTINGS and req.storage != "copy":
            notes.append(f"{key} not applied: no disk is copied (--storage {req.storage})")
        else:
            notes.append(f"{key} not applied: {why}")
    io_qos = bool(lm["io-qos"]) and req.storage == "copy"
    if lm["io-qos"] and not io_qos:
        notes.append(f"io-qos not applied: no disk is copied (--storage {req.storage})")
    drain = _drain(str(lm["switchover-drain"]), qemu, notes)
    if drain:
        src_caps[DRAIN_NEEDS] = True  # libvirt sets it too; QEMU wants it with the drain
        src_caps[DRAIN_CAP] = True

    # storage, bandwidth, destination
    if req.storage == "copy":
        flags |= NON_SHARED_DISK
        if req.disks:
            params[P_MIGRATE_DISKS] = list(req.disks)
    elif req.unsafe:
        flags |= UNSAFE
    if req.bandwidth is not None:
        params[P_BANDWIDTH] = mib(req.bandwidth)
        if flags & POSTCOPY:  # else post-copy runs unlimited
            params[P_BANDWIDTH_POSTCOPY] = mib(req.bandwidth)
    if req.migrate_uri:
        params[P_URI] = req.migrate_uri
    if req.tls:  # the daemons' qemu.conf names the certificates (migrate_tls_x509_*)
        flags |= TLS
        if req.tls_destination:  # else libvirt checks the NBD copy's server against a
            params[P_TLS_DESTINATION] = req.tls_destination  # name of its own choosing
    if req.verify and req.storage == "copy":
        flags |= PAUSED  # the images are compared before the destination runs
    dst_globals = {k: str(v) for k, v in src_qmp.items() if k in STREAM_PARAMS}
    if src_caps.get(SWITCH_CAP):
        # the destination loads each packet with the codec that sent it: libvirt starts
        # that QEMU and sets its capabilities itself, so it gets this one by -global
        dst_globals[SWITCH_CAP] = "on"
    switchover_bw = bool(lm.get("switchover-bandwidth")) and SWITCHOVER_BW not in src_qmp
    if switchover_bw and SWITCHOVER_BW not in qemu.parameters:
        switchover_bw = False
        notes.append(f"switchover-bandwidth not applied: the domain's QEMU has no "
                     f"{SWITCHOVER_BW} parameter (QEMU 8.2 added it)")
    ram_check, why = _ram_check(qemu, req, flags, src_caps, ram_check_budget_s(lm))
    if ram_check:
        src_caps[RAM_CHECK_CAP] = True
    if req.ram_fault is not None:
        if not ram_check:
            raise UsageError(f"--inject-fault ram-byte needs the in-stream RAM check, "
                             f"which is off: {why}")
        dst_globals[RAM_CHECK_FAULT] = str(req.ram_fault)
    return Plan(flags=flags, params=params, src_qmp=src_qmp, src_caps=src_caps,
                dst_globals=dst_globals, downtime_ms=downtime, throttle=throttle,
                throttle_knob=knob, downtime_ramp=bool(lm["downtime-ramp"]),
                max_downtime=int(lm["max-downtime"]), on_stall=on_stall,
                postcopy_after=float(lm.get("postcopy-after") or 0),
                poll_interval=float(lm["poll-interval"]), notes=tuple(notes),
                stall_timeout=float(lm["stall-timeout"]), ram_check=ram_check,
                ram_check_why=why, disk_check=str(lm["disk-check"]),
                io_qos=io_qos, drain=drain, switchover_bandwidth=switchover_bw)


def _drain(mode: str, qemu: QemuInfo, notes: list[str]) -> bool:
    """Whether the source drains before the switchover (``switchover-drain``)."""
    if mode == "off":
        return False
    if DRAIN_CAP not in qemu.capabilities or DRAIN_NEEDS not in qemu.capabilities:
        if mode == "on":
            raise UsageError(f"switchover-drain=on needs the patched QEMU's {DRAIN_CAP} "
                             "capability (patch 0007); the domain's emulator lacks it")
        notes.append(f"switchover-drain not applied: {qemu.who} has no {DRAIN_CAP} "
                     "capability (patch 0007 of livemig's series)")
        return False
    return True


def disk_check_method(wanted: str, one_machine: bool) -> str:
    """``nbd``, ``file`` or ``stream``: how copied disks are compared. ``auto`` is
    ``nbd`` (see :func:`disk_check_fallback` for when it cannot run)."""
    if wanted == "auto":
        return "nbd"
    if wanted == "file" and not one_machine:
        raise UsageError("--set disk-check=file needs both hosts' images on this machine "
                         "(the testbed); between hosts use disk-check=nbd or stream (or "
                         "auto)")
    return wanted


def disk_check_fallback(one_machine: bool) -> str:
    """What ``auto`` compares with when the NBD exports could not be made: the image
    files when this machine sees both hosts' (the testbed), else libvirt's volume
    streams (raw images only)."""
    return "file" if one_machine else "stream"


def _ram_check(qemu: QemuInfo, req: Request, flags: int,
               src_caps: Mapping[str, bool], budget: float | None = None
               ) -> tuple[bool, str]:
    """Whether the source sends its RAM digests in the stream (patch 0006), or why not.

    libvirt stops the source QEMU inside the call that completes the migration, so
    the source cannot be digested from outside once it is frozen; the check has to
    happen inside the migration, where QEMU fails it on a mismatch (libvirt then
    resumes the source). QEMU digests all of RAM there, the source and then the
    destination, inside the guest's pause: a guest whose estimate
    (:data:`IN_STREAM_S_PER_GIB`) does not fit the ``ram-check-budget`` goes without.
    """
    if not req.verify:
        return False, "--no-verify"
    if RAM_CHECK_CAP not in qemu.capabilities:
        return False, (f"{qemu.who} has no {RAM_CHECK_CAP} capability (patch 0006 "
                       "of livemig's series adds it); libvirt stops the source QEMU in "
                       "the call that completes the migration, so it cannot be "
                       "digested from outside")
    if flags & POSTCOPY:
        return False, (f"post-copy: the destination runs before all RAM has arrived "
                       f"(QEMU refuses {RAM_CHECK_CAP} with postcopy-ram)")
    if src_caps.get(RAM_CHECK_CAP) is False:
        return False, f"--set {RAM_CHECK_CAP}=off"
    if RAM_CHECK_CAP in src_caps:  # --set x-ram-digest-check=on: asked for, whatever it costs
        return True, ""
    pause = (qemu.ram_bytes or 0) / (1 << 30) * IN_STREAM_S_PER_GIB
    if budget is not None and pause > budget:
        return False, (f"QEMU's in-stream digest of {(qemu.ram_bytes or 0) / (1 << 30):.0f} "
                       f"GiB would add ~{pause:.1f} s to the guest's pause, over the "
                       f"{budget:g} s ram-check-budget (--set ram-check-budget=0: no limit)")
    return True, ""


def mib(bytes_per_s: int) -> int:
    """libvirt's migration bandwidth is in MiB/s: round up, never to 0 (= unlimited)."""
    return max(1, math.ceil(bytes_per_s / (1 << 20)))


def _stream_global_re() -> re.Pattern[str]:
    keys = "|".join(re.escape(k) for k in sorted(STREAM_PARAMS | {SWITCH_CAP}))
    q = "[\"']"
    return re.compile(rf"<qemu:arg\s+value={q}-global{q}\s*/>\s*"
                      rf"<qemu:arg\s+value={q}migration\.(?:{keys})=[^\"']*{q}\s*/>\s*")


def has_stream_globals(xml: str) -> bool:
    """Whether the domain's live XML still carries a stream ``-global`` an earlier
    livemig migration gave its QEMU (it travels with the domain's live XML)."""
    return bool(_stream_global_re().search(xml))


def with_globals(xml: str, globals_: Mapping[str, str]) -> str:
    """The domain's XML with ``-global migration.K=V`` for its QEMU (destination).
    Stream globals an earlier migration left in the live XML are dropped first: a
    stale one would come after ours and win, and the two ends would disagree on the
    stream's encoding."""
    xml = _stream_global_re().sub("", xml)
    xml = re.sub(r"<qemu:commandline>\s*</qemu:commandline>", "", xml)
    if not globals_:
        return xml
    ns = "http://libvirt.org/schemas/domain/qemu/1.0"
    args = "".join(f"<qemu:arg value='-global'/><qemu:arg value='migration.{k}={v}'/>"
                   for k, v in sorted(globals_.items()))
    head, sep, tail = xml.rpartition("</domain>")
    if not sep:
        raise UsageError("the domain's XML has no </domain>")
    if "<qemu:commandline>" in head:
        head = head.replace("<qemu:commandline>", "<qemu:commandline>" + args, 1)
        body = head
    else:
        body = head + f"<qemu:commandline>{args}</qemu:commandline>"
    if f"xmlns:qemu='{ns}'" not in body and f'xmlns:qemu="{ns}"' not in body:
        body = body.replace("<domain ", f"<domain xmlns:qemu='{ns}' ", 1)
    return body + sep + tail
