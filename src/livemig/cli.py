"""``livemig`` command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from livemig import __version__, qemucaps
from livemig.accel import choose_accel
from livemig.engine.plan import DEFAULT_MAX_TIME_S, Plan
from livemig.errors import FaultInjectionRefused, LivemigError, UsageError
from livemig.paths import default_qemu, ensure_root, require_file
from livemig.progress import Progress
from livemig.report import build_report, summary, write_report
from livemig.settings import LIVEMIG_SETTINGS, PROFILES, merge, parse_sets
from livemig.spec import parse_workload
from livemig.units import parse_link_rate, parse_size

if TYPE_CHECKING:  # the lab is imported where a lab run needs it: `migrate --domain`
    # and attach children (an evacuation starts one per VM) start without it
    from livemig.lab.run import Fault, LabRun, MigrateOptions

EXIT_ABORTED = 3
EXIT_MISMATCH = 4
FAULT_ENV = "LIVEMIG_ALLOW_FAULT_INJECTION"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"livemig: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


# commands whose module registers them (its own imports come with it: the TLS
# library, the lab, the testbed, ...); each is imported only when its command is run
# or every command is listed (``--help``, an unknown command): a cold ``livemig
# migrate`` spent 1.3 s importing all of them
REGISTERED = {"testbed": "livemig.testbed.cli", "upgrade": "livemig.upgrade.cli",
              "pki": "livemig.tls.cli", "evacuate": "livemig.evacuate.cli",
              "soak": "livemig.soak.cli", "install-qemu": "livemig.install.cli",
              "doctor": "livemig.doctor.cli"}
BUILT_IN = frozenset({"migrate", "bench", "verify", "settings"})


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option)."""
    return next((x for x in argv if not x.startswith("-")), None)


def _build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """livemig's parser; with ``command``, only that command's module is imported
    (all of them when it is none of livemig's)."""
    p = _Parser(prog="livemig", description=(
        "Live migration of QEMU/KVM VMs that converges under load, verified."))
    p.add_argument("--version", action="version", version=f"livemig {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    m = sub.add_parser("migrate", help="migrate a VM live (a lab guest, or any QEMU with "
                       "--src-qmp/--dst-qmp), verify, report",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_MIGRATE_DOC)
    m.add_argument("--src-qmp", type=Path, metavar="PATH",
                   help="attach: QMP socket of a running source QEMU")
    m.add_argument("--dst-qmp", type=Path, metavar="PATH",
                   help="attach: QMP socket of a destination QEMU started with "
                        "-incoming defer -S")
    m.add_argument("--dst-start", action="store_true",
                   help="attach: instead of --dst-qmp, start the destination on this host "
                        "from the source's command line (+ -incoming defer -S)")
    m.add_argument("--uri", help="attach: what the destination listens on (tcp:HOST:PORT)")
    m.add_argument("--memory", help=f"guest RAM (default {LAB_DEFAULTS['memory']})")
    m.add_argument("--vcpus", type=int, help="guest vCPUs (default 1)")
    m.add_argument("--workload",
                   help="workload spec, e.g. mem:size=512M,rate=200M,hot=80/10+disk:bs=8K "
                        f"(default {LAB_DEFAULTS['workload']})")
    m.add_argument("--bandwidth", help="cap on the migration stream, bytes/s (e.g. 64M)")
    m.add_argument("--link",
                   help="rate of the testbed's migration link between the src and dst "
                        "hosts: 100mbit, 1gbit, 10gbit, none (unshaped), or local (no "
                        "testbed: both QEMUs on this host, loopback) (default 1gbit)")
    m.add_argument("--storage", choices=("shared", "copy"),
                   help="shared: one disk image both hosts use; copy: each host has its "
                        "own and the disk is mirrored over NBD first (default shared)")
    m.add_argument("--net", metavar="tap|vhost-user[,queues=N]",
                   help="the guest NIC's backend on the testbed: tap (default, QEMU's tap "
                   "bridged to the guest network) or vhost-user (virtio-net with N queue "
                   "pairs on an Open vSwitch + DPDK switch per host)")
    m.add_argument("--profile", default="livemig", choices=list(PROFILES),
                   help="settings preset (default livemig)")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a QEMU capability/parameter or livemig setting "
                        "(repeatable)")
    m.add_argument("--tls", choices=("auto", "on", "off"), default="auto",
                   help="encrypt the migration stream and accept only the expected peer "
                   "(x509 certificates, tls-authz). auto (default): on unless both ends "
                   "are on this host: a lab run on the testbed's two hosts is on, --link "
                   "local is off; attach is off only when --uri is unix: or a loopback "
                   "address (then the destination listens on this host, and the source "
                   "that connects to it runs here too); libvirt (VIR_MIGRATE_TLS) is off "
                   "only when --connect and --to name the same host")
    m.add_argument("--tls-dir", type=Path, metavar="DIR",
                   help="attach: credentials in QEMU's layout (ca-cert.pem, "
                   "server-*.pem, client-*.pem); default: /etc/pki/qemu, "
                   "/etc/pki/libvirt-migrate, then livemig pki's /etc/pki/livemig/HOST")
    m.add_argument("--max-time", type=_max_time, default=DEFAULT_MAX_TIME_S,
                   metavar="SECONDS", help="cancel if not done after SECONDS (the source "
                   f"keeps running); default {DEFAULT_MAX_TIME_S:g}: a full pass of a 64 "
                   "GiB guest at 1 Gbit/s takes about 9 minutes, and a migration still "
                   "running after 15 is not converging but keeps the guest throttled; "
                   "'none': no limit")
    m.add_argument("--report", type=Path, help="write the JSON report here")
    m.add_argument("--qemu", type=Path, help="QEMU binary (default build/qemu/...)")
    m.add_argument("--accel", default="auto", help="auto|kvm|tcg (default auto)")
    m.add_argument("--no-verify", action="store_true", help="skip the RAM comparison")
    m.add_argument("--disk-size", help="guest disk size when the "
                   "workload writes to disk (default 256M)")
    m.add_argument("--disk-fill", choices=("zero", "mixed"),
                   help="what the source disk holds at the start: zero (sparse, "
                        "default) or mixed data like a used disk")
    m.add_argument("--inject-fault", action="append", default=[], metavar="KIND@ADDR",
                   help=f"debug: corrupt the destination before the comparison: "
                        f"ram-byte@0xGUESTADDR, disk-byte@OFFSET, ram-stamped@N or "
                        f"disk-stamped@N (a block the guest checker owns); needs "
                        f"{FAULT_ENV}=1")
    m.add_argument("--qemu-trace", action="append", default=[], metavar="EVENT",
                   help="log a QEMU trace point on both ends (repeatable; 'bitmap' = bitmap "
                   "syncs and downtime steps); parsed into the report's qemu_trace")
    m.add_argument("--keep-run-dir", action="store_true", help="keep logs of a good run")
    m.add_argument("--run-id", help="name of this run (default: random); QEMU processes "
                   "are named livemig-RUNID-src/dst")
    m.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    lv = m.add_argument_group("libvirt (migrate a running domain between two daemons)")
    lv.add_argument("--domain", metavar="NAME", help="the libvirt domain to migrate "
                    "(instead of a lab VM)")
    lv.add_argument("--connect", metavar="SRC_URI", help="the source daemon, e.g. "
                    "qemu+tcp://10.77.0.1/system (livemig testbed libvirt-uri src)")
    lv.add_argument("--to", metavar="DST_URI", help="the destination daemon")
    lv.add_argument("--unsafe", action="store_true", help="pass VIR_MIGRATE_UNSAFE: the "
                    "disk is shared but libvirt cannot tell (e.g. one local file both "
                    "testbed hosts see)")
    lv.add_argument("--migrate-uri", metavar="URI", help="where the migration stream "
                    "goes (default: the destination's migration_host)")

    b = sub.add_parser("bench", help="run scenarios x profiles side by side")
    b.add_argument("scenarios", nargs="+", type=Path, help="scenario files (bench/scenarios)")
    b.add_argument("--profiles", help="comma-separated profiles (default: the scenario's)")
    b.add_argument("--repeats", type=int, help="runs per profile (default: the scenario's)")
    b.add_argument("--out", type=Path, default=Path("reports/bench"), help="output directory")
    b.add_argument("--families", help="comma-separated family names of a matrix file "
                   "(default: all)")
    b.add_argument("--resume", action="store_true", help="keep the reports already in "
                   "--out and run only the missing ones")
    b.add_argument("--summarize", action="store_true", help="no runs: summarize the "
                   "reports already in --out")
    b.add_argument("--qemu", type=Path, help="QEMU binary for the livemig profiles "
                   "(default build/qemu/...)")
    b.add_argument("--stock-qemu", type=Path, help="QEMU binary for the stock profiles "
                   "(default: the unpatched build of the same release, "
                   "build/qemu-upstream/..., from 'make qemu-upstream'; 'same': --qemu)")
    b.add_argument("--accel", default="auto", help="auto|kvm|tcg")
    b.add_argument("--via", choices=("lab", "attach", "libvirt"), default="lab",
                   help="lab: the lab drives the migration with its own hooks; attach: the "
                   "lab boots and measures the guests, then hands their QMP sockets to "
                   "the attach path, which migrates them as a user's VMs; libvirt: each "
                   "guest is a domain of the testbed's libvirt daemons, migrated by "
                   "'livemig migrate --domain' (default lab)")
    b.add_argument("-q", "--quiet", action="store_true", help="no live progress")

    v = sub.add_parser("verify", help="migrate one guest back and forth under its "
                       "consistency checker, cycling feature combinations",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_VERIFY_DOC)
    v.add_argument("--rounds", type=int, default=11, help="migrations (default 11: each "
                   "combination once); a soak: --rounds 100")
    v.add_argument("--combinations", help="comma-separated subset, in the order to "
                   "cycle through (default: all; see 'livemig verify --list')")
    v.add_argument("--list", action="store_true", help="list the combinations and exit")
    v.add_argument("--memory", default="512M", help="guest RAM (default 512M)")
    v.add_argument("--workload", help="workload spec; must include verify:... "
                   "(default: the checker on 64M of RAM and 32M of disk, plus a memory "
                   "and a disk writer)")
    v.add_argument("--inject", metavar="KIND", help="corrupt every migration's "
                   "destination on purpose: ram-stamped or disk-stamped (needs "
                   f"{FAULT_ENV}=1)")
    v.add_argument("--max-time", type=_max_time, default=180.0,
                   help="per migration, seconds (default 180)")
    v.add_argument("--report", type=Path, help="write the JSON summary here")
    v.add_argument("--qemu", type=Path, help="QEMU binary (default build/qemu/...)")
    v.add_argument("--accel", default="auto", help="auto|kvm|tcg")

    s = sub.add_parser("settings", help="list profiles and livemig settings")
    s.add_argument("--profile", choices=list(PROFILES))

    for name, module in REGISTERED.items():
        if command in BUILT_IN or (command in REGISTERED and command != name):
            continue  # another command: its module and what it imports stay unloaded
        try:
            mod = importlib.import_module(module)
        except ImportError:  # the testbed is not installed in this checkout
            if name == "testbed":
                continue
            raise
        mod.register(sub)
    return p


LAB_DEFAULTS: dict[str, object] = {
    "memory": "1G", "vcpus": 1, "workload": "mem:size=256M,rate=64M,hot=80/10",
    "link": "1gbit", "storage": "shared", "disk_size": "256M", "disk_fill": "zero",
    "net": "tap",
}
LAB_ONLY = ("memory", "vcpus", "workload", "link", "storage", "disk_size", "disk_fill", "net",
            "qemu", "inject_fault", "run_id", "keep_run_dir", "qemu_trace")


_MIGRATE_DOC = """\
Lab run (default): boot a source VM running a workload on the testbed's src host
and a destination VM on its dst host (network namespaces joined by a shaped link,
created when needed), migrate the guest live while a client probes it over the
network, compare its RAM page by page (and its disk, with --storage copy), report.

With --domain NAME --connect SRC_URI --to DST_URI: migrate a running libvirt domain
between two libvirt daemons instead, through libvirt's API, with the profile applied
through libvirt's migration parameters and the monitor passthrough (README: libvirt).

exit status: 0 completed and consistent, 1 failed, 2 bad usage, 3 aborted
(--max-time or Ctrl-C; the source keeps running), 4 a consistency mismatch was
found: the migration failed, the destination never ran, the source runs on (lab
and attach runs; libvirt: a copied disk that differs is held paused on the
destination).

Attach run: livemig migrate --src-qmp SRC.sock --dst-qmp DST.sock --uri tcp:HOST:PORT
migrates a VM livemig did not start: the source any running QEMU, the destination a
QEMU started with -incoming defer -S. livemig verifies the destination's RAM against
the frozen source (QEMU's RAM digest), resumes it, and sets back every migration
setting it changed, on both ends; if livemig dies, a guardian process does it."""


_VERIFY_DOC = """\
Boot one guest running the stamp-and-verify checker and a dirtying workload on the
testbed's src host, then migrate it src -> dst -> src ... --rounds times, each time
with the next feature combination (plain, multifd 2/4, zstd, lz4, lz4 with bypass,
hot-page deferral, direct throttle, cross-storage copy, with and without the shaped
link). Every migration also compares RAM (and the disk when copied) exactly.

exit status: 0 every migration completed with no mismatch (and, with --inject, every
fault detected), 1 a migration failed, 2 bad usage, 4 a mismatch was found or an
injected fault went undetected."""


def _max_time(text: str) -> float | None:
    """``--max-time``: a number of seconds, or ``none``; its range is checked with
    the plan (:meth:`Plan.validate`: finite and positive)."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds, or none") from None


def host_memory() -> int | None:
    """This host's RAM in bytes (MemTotal), or None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _trace_events(names: list[str]) -> tuple[str, ...]:
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z0-9_*]{1,80}", n)]
    if bad:
        raise UsageError(f"--qemu-trace {bad[0]!r}: a trace point name or 'bitmap'")
    from livemig.lab import qemutrace

    return qemutrace.expand(names)


def _parse_faults(items: list[str]) -> list[Fault]:
    from livemig.lab.run import FAULT_KINDS, Fault

    if not items:
        return []
    if os.environ.get(FAULT_ENV) != "1":
        raise FaultInjectionRefused(
            f"--inject-fault corrupts the migrated guest on purpose; set {FAULT_ENV}=1 "
            "to allow it")
    faults = []
    for item in items:
        kind, sep, addr = item.partition("@")
        if kind not in FAULT_KINDS or not sep:
            raise UsageError(f"bad --inject-fault {item!r}: expected KIND@NUMBER with "
                             f"KIND one of {', '.join(FAULT_KINDS)}")
        try:
            faults.append(Fault(kind, int(addr, 0)))
        except ValueError:
            raise UsageError(f"bad --inject-fault address {addr!r}") from None
    return faults


def _migrate_options(a: argparse.Namespace) -> MigrateOptions:
    from livemig.lab.net import parse_net
    from livemig.lab.run import MigrateOptions

    for key, value in LAB_DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    workload = parse_workload(a.workload)
    net = parse_net(a.net)
    memory = parse_size(a.memory, "--memory")
    if memory < 128 << 20 or memory % (1 << 20):
        raise UsageError("--memory must be a whole number of MiB, at least 128M")
    host = host_memory()
    if host is not None and memory > host:
        raise UsageError(f"--memory {a.memory}: more than this host's RAM "
                         f"({host / (1 << 30):.1f} GiB)")
    disk_size = parse_size(a.disk_size, "--disk-size")
    if disk_size < 1 << 20:
        raise UsageError("--disk-size must be at least 1M")
    if not 1 <= a.vcpus <= 64:
        raise UsageError("--vcpus must be in 1..64")
    sets = parse_sets(a.set)
    wanted = merge(a.profile, sets)
    opts = MigrateOptions(
        workload=workload, memory=memory, vcpus=a.vcpus,
        bandwidth=parse_size(a.bandwidth, "--bandwidth") if a.bandwidth else None,
        profile=a.profile, wanted=wanted, max_time=a.max_time,
        verify=not a.no_verify, faults=_parse_faults(a.inject_fault),
        disk_size=disk_size,
        keep_run_dir=a.keep_run_dir, run_id=a.run_id,
        testbed=a.link.strip().lower() != "local",
        link=None if a.link.strip().lower() == "local" else parse_link_rate(a.link),
        storage=a.storage, disk_fill=a.disk_fill, explicit=frozenset(sets), net=net,
        trace_events=_trace_events(a.qemu_trace), tls=a.tls,
    )
    if a.tls_dir is not None:
        raise UsageError("--tls-dir is for attach and libvirt runs: the lab makes its own "
                         "PKI for the testbed's hosts")
    if net.vhost_user and not opts.testbed:
        raise UsageError("--net vhost-user needs the testbed's hosts: not with --link local")
    if opts.storage == "copy" and not opts.testbed:
        raise UsageError("--storage copy needs the testbed's hosts: not with --link local")
    if opts.storage == "copy" and not (workload.disk or (workload.verify and
                                                         workload.verify.disk)):
        raise UsageError("--storage copy needs a workload with a disk "
                         "(e.g. --workload mem:size=128M+disk:bs=8K,rate=2M)")
    if a.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", a.run_id):
        raise UsageError("--run-id must be 1-32 letters, digits, - or _")
    if a.qemu:
        opts.qemu = a.qemu
    if a.report and a.report.is_dir():
        raise UsageError(f"--report {a.report} is a directory")
    choice = choose_accel(a.accel)
    opts.accel, opts.accel_reason = choice.name, choice.reason
    plan = opts.plan()  # the whole plan validated before anything boots
    # every --set key and value against what this QEMU binary offers (cached per
    # binary): a typo fails here, not after two guests booted
    require_file(opts.qemu, "QEMU binary", "run 'make setup' or pass --qemu")
    qemucaps.check_settings(opts.qemu, plan.wanted)
    from livemig.tls.creds import enabled as tls_enabled

    if tls_enabled(opts.tls, one_host=not opts.testbed):  # GnuTLS: asked in the same probe
        qemucaps.check_tls(opts.qemu)
    return opts


def _attach_plan(a: argparse.Namespace) -> Plan:
    if a.dst_start and a.dst_qmp:
        raise UsageError("--dst-start starts the destination: not with --dst-qmp")
    given = [k for k in ("src_qmp", "dst_qmp", "uri") if getattr(a, k)]
    given += ["dst_qmp"] if a.dst_start else []
    missing = [f"--{k.replace('_', '-')}" for k in ("src_qmp", "dst_qmp", "uri")
               if k not in given]
    if missing:
        raise UsageError(f"attach needs --src-qmp, --dst-qmp and --uri: missing "
                         f"{', '.join(missing)}")
    lab = [f"--{k.replace('_', '-')}" for k in LAB_ONLY if getattr(a, k)]
    if lab:
        raise UsageError(f"{', '.join(lab)}: only for lab runs, not with --src-qmp")
    sets = parse_sets(a.set)
    plan = Plan(uri=a.uri, settings=tuple(merge(a.profile, sets).items()),
                explicit=frozenset(sets), profile=a.profile,
                bandwidth=parse_size(a.bandwidth, "--bandwidth") if a.bandwidth else None,
                max_time=a.max_time, verify=not a.no_verify, accel="kvm").validate()
    from livemig.tls.creds import attach_tls

    return plan.with_tls(attach_tls(a.tls, a.tls_dir, a.uri))


def finish_run(report: dict[str, Any], path: Path | None, text: str, logs: str = "") -> int:
    """Write the report, print the summary, and map the outcome to the exit status
    (0 completed and consistent, 1 failed, 3 aborted, 4 a consistency mismatch was
    found, whatever the outcome); the same for lab, attach and libvirt runs."""
    if path:
        write_report(report, path)
    print(text)
    if path:
        print(f"report           {path}")
    cons = report["consistency"]
    assert isinstance(cons, dict)
    mismatch = "mismatch" in (cons.get("ram"), cons.get("disk"), cons.get("guest"))
    if report["outcome"] == "failed":
        print(f"livemig: migration failed: {report['reason']}{logs}", file=sys.stderr)
        return EXIT_MISMATCH if mismatch else 1
    if report["outcome"] == "aborted":
        return EXIT_ABORTED
    return EXIT_MISMATCH if mismatch else 0


def cmd_attach(a: argparse.Namespace) -> int:
    from livemig.attach import run_attach
    from livemig.engine.events import EventStream, progress_listener

    plan = _attach_plan(a)
    if a.report and a.report.is_dir():
        raise UsageError(f"--report {a.report} is a directory")
    progress = Progress(enabled=not a.quiet)
    events = EventStream()
    events.subscribe(progress_listener(progress))

    async def go() -> dict[str, object]:
        interrupt = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt.set)
        try:
            rec, facts = await run_attach(a.src_qmp, None if a.dst_start else a.dst_qmp,
                                          plan, events, interrupt)
        finally:
            progress.close()
        return build_report(rec, facts)

    report = asyncio.run(go())
    return finish_run(report, a.report, summary(report))


async def _run_migration(mig: LabRun) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, mig.interrupt.set)
    await mig.run()


def _reap() -> None:
    from livemig.lab.leftovers import reap

    reap()


def cmd_migrate(a: argparse.Namespace) -> int:
    if a.domain is not None:
        from livemig.virt.cli import cmd_migrate_domain

        a.storage = a.storage or "shared"
        return cmd_migrate_domain(a, vars(_build_parser("migrate").parse_args(["migrate"])))
    if a.connect or a.to or a.unsafe or a.migrate_uri:
        raise UsageError("--connect, --to, --unsafe and --migrate-uri go with --domain")
    if a.src_qmp or a.dst_qmp or a.uri or a.dst_start:
        return cmd_attach(a)
    from livemig.lab.run import LabRun

    opts = _migrate_options(a)
    ensure_root()
    mig = LabRun(opts, Progress(enabled=not a.quiet))
    asyncio.run(_run_migration(mig))
    report = mig.report()
    return finish_run(report, a.report, summary(report), f" (logs: {mig.run_dir})")


def cmd_bench(a: argparse.Namespace) -> int:
    from livemig.bench import binaries, check_profile, load_scenarios, run_bench

    profiles = [p.strip() for p in a.profiles.split(",")] if a.profiles else None
    for p in profiles or []:
        check_profile(p)
    for path in a.scenarios:
        for sc in load_scenarios(path):  # fail early on a bad file or a missing binary
            binaries({**sc, "profiles": profiles or sc["profiles"]}, a.qemu, a.stock_qemu)
    if a.repeats is not None and a.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if a.via == "libvirt":
        for path in a.scenarios:
            for sc in load_scenarios(path):
                if str(sc.get("link", "1gbit")) == "local" or sc.get("storage", "shared") \
                        != "shared":
                    raise UsageError(f"--via libvirt: family {sc['name']!r} needs the testbed "
                                     "(a link rate, not 'local') and shared storage")
    families = [f.strip() for f in a.families.split(",")] if a.families else None
    if families:
        known = {sc["name"] for path in a.scenarios for sc in load_scenarios(path)}
        for f in families:
            if f not in known:
                raise UsageError(f"unknown family {f!r}: choose from {', '.join(sorted(known))}")
    reuse = "only" if a.summarize else "resume" if a.resume else "no"
    if reuse == "only":
        if not a.out.is_dir():
            raise UsageError(f"--summarize: no reports in {a.out}")
        md = asyncio.run(run_bench(a.scenarios, a.out, "-", "", a.qemu, a.repeats,
                                   profiles, a.quiet, a.stock_qemu, reuse, families,
                                   a.via))
        print(md)
        return 0
    ensure_root()
    _reap()
    choice = choose_accel(a.accel)
    md = asyncio.run(run_bench(a.scenarios, a.out, choice.name, choice.reason, a.qemu,
                               a.repeats, profiles, a.quiet, a.stock_qemu, reuse,
                               families, a.via))
    print(md)
    print(f"results in {a.out}/")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from livemig.verify import (
        COMBINATIONS,
        DEFAULT_WORKLOAD,
        INJECT_KINDS,
        PingPong,
        VerifyOptions,
    )

    if a.list:
        for name, c in COMBINATIONS.items():
            sets = " ".join(f"{k}={v}" for k, v in c.sets.items()) or "(QEMU defaults)"
            link = "unshaped" if c.link is None else f"{c.link / 1e9:g}gbit"
            bw = f", bandwidth {c.bandwidth >> 20}M" if c.bandwidth else ""
            print(f"{name:16} {sets}; link {link}, storage {c.storage}{bw}")
        return 0
    if a.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    if a.max_time is None or not (math.isfinite(a.max_time) and a.max_time > 0):
        raise UsageError("--max-time must be a positive number of seconds")
    names = list(COMBINATIONS)
    if a.combinations:
        names = [n.strip() for n in a.combinations.split(",") if n.strip()]
        bad = [n for n in names if n not in COMBINATIONS]
        if bad or not names:
            raise UsageError(f"unknown combination {', '.join(bad) or '(none)'}: choose "
                             f"from {', '.join(COMBINATIONS)}")
    workload = a.workload or DEFAULT_WORKLOAD
    spec = parse_workload(workload)
    if spec.verify is None:
        raise UsageError("the verify workload must include verify:mem=...,disk=...")
    if a.inject is not None:
        if a.inject not in INJECT_KINDS:
            raise UsageError(f"bad --inject {a.inject!r}: choose from "
                             f"{', '.join(INJECT_KINDS)}")
        if os.environ.get(FAULT_ENV) != "1":
            raise FaultInjectionRefused(f"--inject corrupts the migrated guest on purpose; "
                                        f"set {FAULT_ENV}=1 to allow it")
        if a.inject == "disk-stamped" and not any(
                COMBINATIONS[n].storage == "copy" for n in names):
            raise UsageError("--inject disk-stamped needs a combination that copies the "
                             "disk (storage-copy)")
    memory = parse_size(a.memory, "--memory")
    if a.report and a.report.is_dir():
        raise UsageError(f"--report {a.report} is a directory")
    ensure_root()
    _reap()
    choice = choose_accel(a.accel)
    opts = VerifyOptions(rounds=a.rounds, combinations=names, memory=memory,
                         workload=workload, qemu=a.qemu or default_qemu(),
                         accel=choice.name, accel_reason=choice.reason, inject=a.inject,
                         max_time=a.max_time)
    print(f"livemig verify: {a.rounds} migrations, accel {choice.name}, workload {workload}",
          file=sys.stderr)
    pp = PingPong(opts, lambda line: print(f"livemig: {line}", file=sys.stderr, flush=True))

    async def go() -> dict[str, object]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, pp.interrupt)
        return await pp.run()

    result = asyncio.run(go())
    if a.report:
        write_report(result, a.report)
    print(f"migrations       {result['migrations']} ({result['completed']} completed)")
    combos: dict[str, dict[str, Any]] = result["by_combination"]  # type: ignore[assignment]
    for name, b in combos.items():
        print(f"  {name:16} {b['migrations']} migrations, {b['completed']} completed, "
              f"{b['mismatches']} mismatches")
    print(f"mismatches       {result['mismatches']}")
    if a.inject:
        print(f"injected         {result['injected']} ({a.inject}); detected "
              f"{result['detected']} (host named {result['detected_by_host']}, "
              f"guest checker named {result['detected_by_guest']})")
    if a.report:
        print(f"report           {a.report}")
    if result["completed"] != result["migrations"] or result["interrupted"]:
        return 1
    if result["mismatches"] or result["detected"] != result["injected"]:
        return EXIT_MISMATCH
    return 0


def cmd_settings(a: argparse.Namespace) -> int:
    names = [a.profile] if a.profile else list(PROFILES)
    for name in names:
        items = " ".join(f"{k}={v}" for k, v in PROFILES[name].items()) or "(QEMU defaults)"
        print(f"profile {name}: {items}")
    print("livemig settings:")
    for key, st in LIVEMIG_SETTINGS.items():
        print(f"  {key}={st.default}  {st.doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser(command_of(sys.argv[1:] if argv is None else argv))
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(a.verbose, 2),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not a.verbose:
        # qemu.qmp logs every refused connection attempt as an ERROR (a stale socket
        # path gave ~200 lines before livemig's own one-line error); livemig reports
        # what matters, -v shows the library's log
        logging.getLogger("qemu.qmp").setLevel(logging.CRITICAL)
    handlers = {"migrate": cmd_migrate, "bench": cmd_bench, "settings": cmd_settings,
                "verify": cmd_verify}
    try:
        if a.command in handlers:
            return handlers[a.command](a)
        if hasattr(a, "func"):
            return int(a.func(a) or 0)
        parser.print_help()
        return 2
    except LivemigError as e:
        print(f"livemig: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("livemig: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a file or socket the run needed: one line, not a traceback
        print(f"livemig: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
