"""Attach: migrate a VM livemig did not start, between two running QEMUs.

The source is any running QEMU, given by its QMP socket; the destination a QEMU the
user started with ``-incoming defer -S`` (as libvirt does), given by its socket;
``--uri`` is what the destination will listen on. livemig checks both ends, hands
them to the engine, and never kills or reconfigures them beyond what the migration
needs: every capability and parameter it changed is set back at the end, and the
engine's guardian does the same if livemig dies. One exception, after an abort or a
failure: a destination that never held the guest and still listens on the migration
port is quit (QEMU 10.2 cannot close that port otherwise; :mod:`livemig.engine.listener`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import subprocess
import uuid
from pathlib import Path

from livemig import dststart, idlecpu, paths
from livemig.engine.adapt import Hints, adapt, multifd_codecs
from livemig.engine.endpoint import (
    Endpoint,
    process_argv,
    require_socket,
    socket_peer_pid,
)
from livemig.engine.events import EventStream
from livemig.engine.listener import quit_unused_destination
from livemig.engine.negotiate import read, source_only
from livemig.engine.plan import Plan
from livemig.engine.record import MigrationRecord
from livemig.engine.run import Engine
from livemig.errors import UsageError, VMError
from livemig.policy.encoding import DELTA_KEY
from livemig.report import AttachFacts
from livemig.sampling.readers import qemu_is_local
from livemig.settings import SWITCH_CAP, resolve

CONNECT_TIMEOUT_S = 10.0


async def _connect(name: str, what: str, path: Path) -> Endpoint:
    require_socket(path, what)
    pid = socket_peer_pid(path)
    end = Endpoint(name, path, pid=pid)
    try:
        await end.connect(CONNECT_TIMEOUT_S)
    except VMError as e:
        raise UsageError(f"{what} {path}: cannot connect to QMP ({e})") from None
    return end


async def check_ends(src: Endpoint, dst: Endpoint, plan: Plan) -> None:
    """One-line usage errors for ends that cannot be migrated as asked."""
    st = (await src.cmd("query-status")).get("status")
    if st != "running":
        raise UsageError(f"source {src.socket_path}: VM is {st}, not running")
    mig = (await src.cmd("query-migrate")).get("status", "none")
    if mig not in ("none", "completed", "failed", "cancelled"):
        raise UsageError(f"source {src.socket_path}: a migration is already {mig}")
    dst_st = (await dst.cmd("query-status")).get("status")
    if dst_st != "inmigrate":
        raise UsageError(f"destination {dst.socket_path}: VM is {dst_st}, not waiting for "
                         "a migration (start it with -incoming defer -S)")
    argv = process_argv(dst.pid) if dst.pid is not None else None
    if argv is not None:
        if "-incoming" in argv:
            i = argv.index("-incoming")
            if i + 1 < len(argv) and argv[i + 1] != "defer":
                raise UsageError(f"destination {dst.socket_path}: started with -incoming "
                                 f"{argv[i + 1]}; livemig needs -incoming defer (a QEMU "
                                 "listening from its start refuses multifd): restart it "
                                 "with -incoming defer -S and give livemig --uri")
        if plan.verify and "-S" not in argv:
            raise UsageError(f"destination {dst.socket_path}: not started with -S: it "
                             "would run before its RAM is verified (add -S, or "
                             "--no-verify)")


async def _accel(src: Endpoint) -> str:
    with contextlib.suppress(VMError):
        if (await src.cmd("query-kvm")).get("enabled"):
            return "kvm"
    return "tcg"


async def _start_destination(src: Endpoint, run_dir: Path
                             ) -> tuple[Endpoint, subprocess.Popen[bytes]]:
    """``--dst-start``: the destination from the source's command line (this host)."""
    argv = process_argv(src.pid) if src.pid is not None else None
    if not argv:
        raise UsageError("--dst-start: cannot read the source QEMU's command line (it "
                         "must run on this host)")
    dargv, qmp = dststart.destination_argv(argv, run_dir)
    proc = await asyncio.to_thread(dststart.start, dargv, run_dir)
    end = Endpoint("dst", qmp, pid=proc.pid, alive=lambda: proc.poll() is None)
    await end.connect(CONNECT_TIMEOUT_S)
    return end, proc


async def _stop(end: Endpoint, proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(end.cmd("quit"), 2.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        await asyncio.to_thread(proc.wait, 5)
    if proc.poll() is None:
        proc.kill()
        await asyncio.to_thread(proc.wait, 5)


async def _close_listener(dst: Endpoint, events: EventStream) -> None:
    """After an abort or failure: the user's destination, if it never held the guest,
    is quit so that its incoming port closes (:mod:`livemig.engine.listener`)."""
    def tell(line: str) -> None:
        events.event("destination quit", reason=line)
        events.say(line)

    if dst.alive():
        await quit_unused_destination(dst, tell)


async def run_attach(src_qmp: Path, dst_qmp: Path | None, plan: Plan, events: EventStream,
                     interrupt: asyncio.Event) -> tuple[MigrationRecord, AttachFacts]:
    """Attach to ``src_qmp``; the destination at ``dst_qmp``, or (None) started by
    livemig from the source's command line."""
    run_id = "a" + uuid.uuid4().hex[:7]
    gdir = paths.run_root() / run_id
    src = await _connect("src", "--src-qmp", src_qmp)
    dst: Endpoint | None = None
    started: subprocess.Popen[bytes] | None = None
    rec: MigrationRecord | None = None
    try:
        now = await read(src)  # --set checked against the source before anything starts
        resolve(plan.wanted, now.capabilities, now.parameters)
        if dst_qmp is None:
            dst, started = await _start_destination(src, gdir)
            events.event("destination started", argv=started.args, pid=started.pid)
        else:
            dst = await _connect("dst", "--dst-qmp", dst_qmp)
        # the source host's idle CPUs over the checks that follow (a QEMU elsewhere,
        # reached over TCP: not known)
        idle = idlecpu.local() if qemu_is_local(src.pid) else None
        accel = await _accel(src)
        plan = dataclasses.replace(plan, accel=accel).validate()
        await check_ends(src, dst, plan)
        theirs = await read(dst)
        # a destination of another build (a stock QEMU for a patched source): the
        # codecs both ends have
        other = bool(source_only(now, theirs))
        adapted = await adapt(src, plan, Hints(
            scratch=gdir.parent, dst_switch=SWITCH_CAP in theirs.capabilities, idle=idle,
            dst_local=qemu_is_local(dst.pid),
            dst_codecs=await multifd_codecs(dst) if other else None,
            dst_delta=DELTA_KEY in theirs.parameters if other else None), events)
        plan = adapted.plan
        events.say(f"attached: source {src_qmp} (pid {src.pid}), destination "
                   f"{dst.socket_path} (pid {dst.pid}), {accel}; migrating to {plan.uri}")
        engine = Engine(src, dst, plan, events=events, interrupt=interrupt, run_id=run_id,
                        guardian_dir=gdir, encoding=adapted.encoding,
                        deferred=adapted.deferred)
        rec = await engine.run()
        if not rec.completed and started is None:
            await _close_listener(dst, events)
            rec = dataclasses.replace(rec, events=tuple(events.log))
    finally:
        if started is not None and dst is not None and (rec is None or not rec.completed):
            await _stop(dst, started)  # livemig started it; the source is the VM
        await src.close()
        if dst is not None:
            await dst.close()
        if started is None or rec is None or not rec.completed:
            # livemig ended normally: the guardian had nothing to repair (a started
            # destination that now runs the guest keeps its sockets there)
            shutil.rmtree(gdir, ignore_errors=True)
    facts = AttachFacts({"src_qmp": str(src_qmp),
                         "dst_qmp": str(dst.socket_path) if dst else None,
                         "dst_started_by_livemig": started is not None,
                         "src_pid": src.pid, "dst_pid": dst.pid if dst else None,
                         "qemu": None})
    return rec, facts
