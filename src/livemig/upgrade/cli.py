"""``livemig upgrade``: replace a VM's QEMU process by another binary, in place."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from livemig import paths, qemucaps
from livemig.accel import choose_accel
from livemig.engine.endpoint import Endpoint, require_socket, socket_peer_pid
from livemig.engine.events import EventStream, progress_listener
from livemig.engine.record import MigrationRecord
from livemig.errors import UsageError, VMError
from livemig.progress import Progress
from livemig.report import AttachFacts, build_report, summary, write_report
from livemig.units import parse_size
from livemig.upgrade import journal, recover
from livemig.upgrade.switch import MODES, Request, Upgrade

DOC = """\
Lab run (--from-qemu): boot a guest with a workload on the testbed's src host (RAM
in a shared file, -machine aux-ram-share=on, tap on the host's bridge), let it run,
then replace its QEMU process by --to-qemu with CPR: guest RAM is handed over, not
copied; the client's probes, the guest's heartbeat and QEMU's downtime are measured.

Attach (--qmp PATH): upgrade a running VM given by its QMP socket. The new QEMU's
command line is the old one's (/proc/PID/cmdline) with the incoming options added;
the old process quits once the new one runs the guest. On failure the old QEMU keeps
(or goes back to) running the guest and the new one is killed.

A VM CPR cannot take (RAM not in a shared memory backend, no aux-ram-share=on, ...)
is refused with the reason (exit 2); with --fallback migrate it is migrated live to
a new process on this host instead.

exit status: 0 upgraded, 1 failed (the old QEMU runs the guest), 2 refused / bad usage
"""


def register(sub: Any) -> None:
    u = sub.add_parser("upgrade", help="replace a VM's QEMU by another binary in place "
                       "(CPR: RAM handed over, not copied)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=DOC)
    u.add_argument("--qmp", type=Path, metavar="PATH", help="attach: QMP socket of a "
                   "running VM")
    u.add_argument("--from-qemu", type=Path, metavar="BIN", help="lab: boot the guest on "
                   "this QEMU")
    u.add_argument("--to-qemu", type=Path, metavar="BIN",
                   help="the QEMU binary to upgrade to (required unless --recover)")
    u.add_argument("--recover", action="store_true",
                   help="put back the sockets an interrupted upgrade left moved aside "
                   "(PATH.livemig-upgrade) and exit")
    u.add_argument("--mode", choices=MODES, default="auto",
                   help="auto (cpr-transfer), cpr-transfer or cpr-exec; for comparison: "
                   "migrate (local live migration) or save-restore (stop, save, restore)")
    u.add_argument("--fallback", choices=["migrate"], help="if CPR refuses the VM: a local "
                   "live migration to the new binary instead")
    u.add_argument("--memory", help="lab: guest RAM (default 1G)")
    u.add_argument("--workload", help="lab: workload spec (default mem:size=256M,rate=64M,"
                   "hot=80/10+verify:mem=64M)")
    u.add_argument("--no-aux-ram-share", action="store_true",
                   help="lab: boot without aux-ram-share=on (a VM CPR refuses)")
    u.add_argument("--link", default="testbed", choices=["testbed", "local"],
                   help="lab: guest on the testbed's src host (default) or on this host")
    u.add_argument("--warmup", type=float, default=3.0, help="lab: seconds before the switch")
    u.add_argument("--settle", type=float, default=3.0, help="lab: seconds after it")
    u.add_argument("--keep-run-dir", action="store_true", help="lab: keep logs and traces")
    u.add_argument("--accel", default="auto", help="lab: auto, tcg or kvm")
    u.add_argument("--report", type=Path, metavar="FILE", help="write the JSON report here")
    u.add_argument("--quiet", action="store_true", help="no progress lines")
    u.set_defaults(func=cmd_upgrade)


def cmd_upgrade(a: argparse.Namespace) -> int:
    if a.recover:
        return _recover()
    if a.to_qemu is None:
        raise UsageError("--to-qemu BIN is required (or --recover)")
    if a.report is not None and a.report.is_dir():
        raise UsageError(f"--report {a.report} is a directory")
    if a.qmp is not None and not os.path.lexists(a.qmp) and journal.mentions(a.qmp):
        raise UsageError(f"--qmp {a.qmp}: moved aside by an interrupted livemig upgrade "
                         f"({journal.aside(str(a.qmp))}): run 'livemig upgrade --recover'")
    paths.require_file(a.to_qemu, "--to-qemu", "pass an existing QEMU binary")
    if (a.qmp is None) == (a.from_qemu is None):
        raise UsageError("give either --qmp PATH (a running VM) or --from-qemu BIN (a lab "
                         "guest)")
    if a.qmp is not None:
        lab_only = [f"--{k.replace('_', '-')}" for k in ("memory", "workload")
                    if getattr(a, k)]
        if lab_only or a.no_aux_ram_share:
            raise UsageError(f"{', '.join(lab_only) or '--no-aux-ram-share'}: only for lab "
                             "runs, not with --qmp")
        require_socket(a.qmp, "--qmp")
    # a QEMU at all, answering migration queries (--to-qemu /bin/true would otherwise
    # replace the VM's QEMU by nothing); asked once, cached
    qemucaps.knobs(a.to_qemu)
    report = asyncio.run(_attach(a) if a.qmp is not None else _lab(a))
    if a.report:
        write_report(report, a.report)
    if not a.quiet:
        print(summary(report))
        print(f"mode             {report.get('mode')}")
        print(f"pause breakdown  {report.get('pause_breakdown')}")
        if a.report:
            print(f"report           {a.report}")
    if report["outcome"] != "completed":
        print(f"livemig: upgrade failed: {report.get('reason')}", file=sys.stderr)
        return 1
    return 0


def _recover() -> int:
    """``--recover``: the sockets interrupted upgrades moved aside go back."""
    found = journal.pending()
    for j in found:
        for line in recover.settle(j):
            print(line)
        for path in journal.recover(j):
            print(f"put back {path}")
        if j.exists() and journal.moved_from(j) and \
                journal.read(j).get("phase") != journal.SWITCH:
            print(f"livemig: {j}: some sockets could not be put back (their paths are "
                  "taken again): left as they are", file=sys.stderr)
    if not found:
        print("nothing to recover")
    return 0


async def _attach(a: argparse.Namespace) -> dict[str, Any]:
    path = require_socket(a.qmp, "--qmp")
    progress = Progress(enabled=not a.quiet)
    events = EventStream()
    events.subscribe(progress_listener(progress))
    run_id = "u" + uuid.uuid4().hex[:7]
    old = Endpoint("old", path, pid=socket_peer_pid(path))
    try:
        await old.connect(10.0)
    except VMError as e:
        raise UsageError(f"--qmp {path}: cannot connect to QMP ({e})") from None
    req = Request(to_qemu=a.to_qemu.resolve(), mode=a.mode, fallback=a.fallback,
                  work_dir=paths.run_root() / f"upgrade-{run_id}")
    t0 = events.t0
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # honoured up to the switch, not in it
        loop.add_signal_handler(sig, interrupt.set)
    try:
        up = Upgrade(old, req, events=events, interrupt=interrupt)
        res = await up.run()
    finally:
        await old.close()
        progress.close()
    if res.new_endpoint is not None:
        await res.new_endpoint.close()  # the new QEMU runs on; livemig only leaves
    import time

    rec = MigrationRecord(run_id=run_id, uri=res.mode, t0=t0, t_migrate=res.t_issue,
                          t_ram=None, t_end=time.time(), t_dst_done=None, t_cont=None,
                          outcome=res.outcome, reason=res.reason,
                          final_stats=res.final_stats, verify=False)
    report = build_report(rec, AttachFacts({"qmp": str(path), "old_pid": res.old_pid,
                                            "new_pid": res.new_pid,
                                            "to_qemu": str(req.to_qemu)}))
    report["mode"] = res.mode
    report["upgrade"] = res.as_dict()
    report["pause_breakdown"] = res.breakdown
    return report


async def _lab(a: argparse.Namespace) -> dict[str, Any]:
    from livemig.lab.run import MigrateOptions
    from livemig.spec import parse_workload
    from livemig.upgrade.lab import UpgradeLab

    paths.require_file(a.from_qemu, "--from-qemu", "pass an existing QEMU binary")
    memory = parse_size(a.memory or "1G", "--memory")
    if memory < 128 << 20 or memory % (1 << 20):
        raise UsageError("--memory must be a whole number of MiB, at least 128M")
    workload = parse_workload(a.workload or "mem:size=256M,rate=64M,hot=80/10+verify:mem=64M")
    if a.warmup < 0 or a.settle < 0:
        raise UsageError("--warmup and --settle must not be negative")
    choice = choose_accel(a.accel)
    opts = MigrateOptions(workload=workload, memory=memory, qemu=a.from_qemu.resolve(),
                          accel=choice.name, accel_reason=choice.reason, verify=False,
                          testbed=a.link == "testbed", link=None, profile="upstream-plain",
                          keep_run_dir=a.keep_run_dir)
    req = Request(to_qemu=a.to_qemu.resolve(), mode=a.mode, fallback=a.fallback)
    lab = UpgradeLab(opts, req, aux_ram_share=not a.no_aux_ram_share,
                     progress=Progress(enabled=not a.quiet), warmup=a.warmup, settle=a.settle)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lab.interrupt.set)
    return await lab.upgrade()
