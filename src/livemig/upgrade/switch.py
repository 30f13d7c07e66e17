"""Replace a running QEMU by another binary on the same host, guest RAM kept in place.

Modes (QEMU 10.2's CPR, docs/devel/migration/CPR.rst):

- ``cpr-transfer``: livemig starts the new QEMU beside the old one with the same
  machine plus ``-incoming unix:MAIN -incoming {cpr channel}``; ``migrate`` with both
  channels makes the old QEMU stop the guest, pass its RAM fds (memory-backend-file
  share=on, aux-ram-share=on memfds) over the cpr channel and its device state over
  the main one; the new QEMU maps the same RAM and resumes the guest. Until the new
  QEMU runs the guest the old one is the VM: any failure kills the new process and
  resumes the old one. Then the old QEMU is told to ``quit``.
- ``cpr-exec``: the old QEMU writes its state to a file and exec()s the new binary
  (``cpr-exec-command``), keeping its pid, its RAM fds and (10.2.2 opens /dev/net/tun
  without O_CLOEXEC) its tap. No way back once exec has succeeded: if the new binary
  fails to start, the VM is gone.
- ``migrate`` (fallback, also for RAM that is not shareable): a local live migration
  through the engine to a new process over a unix socket; RAM in a shared named file
  is not copied (``x-ignore-shared``), anonymous RAM is.

The tap: both processes get the same open tap (``pidfd_getfd``; see
:mod:`livemig.upgrade.argv`). Unix sockets the new QEMU listens on at the same paths
as the old one (QMP, chardevs) would be unlinked by the old QEMU when it quits; they
are moved aside while it does and put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig.engine.endpoint import Endpoint, process_argv, socket_peer_pid
from livemig.engine.events import EventStream
from livemig.engine.plan import Plan
from livemig.engine.run import Engine, Interrupted
from livemig.errors import LivemigError, UsageError, VMError
from livemig.upgrade import argv as argvmod
from livemig.upgrade import journal, procfs, timing

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

MODES = ("auto", "cpr-transfer", "cpr-exec", "migrate", "save-restore")
BASELINES = ("migrate", "save-restore")  # for comparison: no CPR involved
SWITCH_TIMEOUT_S = 120.0 # migrate issued -> the new QEMU runs the guest
START_TIMEOUT_S = 30.0  # the new QEMU listens on its cpr channel / QMP socket
OLD_EXIT_TIMEOUT_S = 10.0
POLL_S = 0.002
AUTO_MODE = "cpr-transfer"  # the mode with a way back (see docs/results/upgrade.md)


class Refused(UsageError):
    """The VM cannot be upgraded in place (exit status 2); the reason is one line."""


@dataclass(frozen=True)
class Request:
    to_qemu: Path
    mode: str = "auto"  # auto | cpr-transfer | cpr-exec
    fallback: str | None = None  # "migrate": a local live migration if CPR refuses
    work_dir: Path = Path("/tmp")
    quit_old: bool = True  # cpr-transfer/migrate: tell the old QEMU to quit afterwards


@dataclass
class Result:
    outcome: str  # completed | failed
    mode: str
    reason: str | None = None
    refused: str | None = None  # why CPR was not possible (the fallback ran)
    old_pid: int | None = None
    new_pid: int | None = None
    t_issue: float | None = None
    t_running: float | None = None
    old_exited: bool | None = None
    downtime_ms: float | None = None  # QEMU's own figure (the old QEMU's)
    total_ms: float | None = None
    final_stats: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, float | bool | None] = field(default_factory=dict)
    new_endpoint: Endpoint | None = None
    new_proc: subprocess.Popen[bytes] | None = None
    new_argv: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "outcome": self.outcome, "reason": self.reason,
                "refused": self.refused, "old_pid": self.old_pid, "new_pid": self.new_pid,
                "old_exited": self.old_exited, "downtime_ms": self.downtime_ms,
                "pause_breakdown": self.breakdown, "new_argv": self.new_argv}


# Called with the new QEMU's pid as soon as it exists (the lab reconnects its agent)
Watcher = Callable[[int], Coroutine[Any, Any, None]]


async def cpr_blockers(end: Endpoint) -> list[str]:
    """Why QEMU would refuse cpr-transfer (its own blocker list; empty: it would not).

    cpr-exec in 10.2.2 registers no blocker for RAM it cannot keep (anonymous RAM is
    not sent, and lost at exec), so livemig asks cpr-transfer's list for both modes."""
    params = await end.cmd("query-migrate-parameters")
    if "mode" not in params:
        return ["this QEMU has no CPR (migration parameter 'mode' missing)"]
    orig = params["mode"]
    try:
        await end.cmd("migrate-set-parameters", mode="cpr-transfer")
        info = await end.cmd("query-migrate")
    finally:
        await end.cmd("migrate-set-parameters", mode=orig)
    return list(info.get("blocked-reasons") or [])


async def supports_cpr_exec(end: Endpoint) -> bool:
    params = await end.cmd("query-migrate-parameters")
    try:
        await end.cmd("migrate-set-parameters", mode="cpr-exec")
    except VMError:
        return False
    await end.cmd("migrate-set-parameters", mode=params.get("mode", "normal"))
    return True


class Upgrade:
    """One in-place upgrade of the QEMU behind ``old`` (connected, pid known)."""

    def __init__(self, old: Endpoint, req: Request, events: EventStream | None = None,
                 watch: Watcher | None = None,
                 interrupt: asyncio.Event | None = None) -> None:
        if old.pid is None:
            raise UsageError(f"{old.socket_path}: cannot tell which process serves it")
        self.old = old
        self.pid = old.pid
        self.req = req
        self.events = events or EventStream()
        self.watch = watch
        argv = process_argv(self.pid)
        if not argv:
            raise UsageError(f"cannot read the command line of pid {self.pid}")
        self.old_argv = argv
        self.work = req.work_dir
        self._grabbed: list[int] = []
        self._moved: list[tuple[str, str]] = []  # sockets moved aside before the switch
        self._tasks: list[asyncio.Task[None]] = []
        # Ctrl-C / SIGTERM: honoured up to the switch (nothing is lost: the old QEMU
        # runs on, the new one goes); from ``migrate`` on the switch takes milliseconds
        # and is finished, so the sockets are never left half-renamed
        self.interrupt = interrupt or asyncio.Event()

    def _check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise Interrupted("interrupted before the switch: the old QEMU runs the guest")

    # -- checks ---------------------------------------------------------------------
    async def choose_mode(self) -> tuple[str, str | None]:
        """(mode, refusal): the CPR mode, or ``migrate`` with the reason CPR is refused.
        Without ``--fallback migrate`` a refusal raises :class:`Refused`."""
        st = (await self.old.cmd("query-status")).get("status")
        if st != "running":
            raise UsageError(f"{self.old.socket_path}: VM is {st}, not running: livemig "
                             "upgrades running guests (cont it first)")
        mig = (await self.old.cmd("query-migrate")).get("status", "none")
        if mig not in ("none", "completed", "failed", "cancelled"):
            raise UsageError(f"{self.old.socket_path}: a migration is already {mig}")
        if self.req.mode in BASELINES:
            return self.req.mode, None
        why: str | None = None
        try:
            argvmod.tap_netdevs(self.old_argv)
            blockers = await cpr_blockers(self.old)
        except UsageError as e:
            blockers = [str(e)]
        if blockers:
            why = _refusal(blockers, self.old_argv)
        mode = self.req.mode
        if why is None and mode == "auto":
            mode = AUTO_MODE
        if why is None and mode == "cpr-exec" and not await supports_cpr_exec(self.old):
            why = "this QEMU has no cpr-exec mode (QEMU >= 10.2 has it)"
        if why is not None:
            if self.req.fallback != "migrate":
                raise Refused(f"cannot upgrade in place: {why} (--fallback migrate does a "
                              "local live migration instead)")
            return "migrate", why
        return mode, None

    async def run(self) -> Result:
        mode, refused = await self.choose_mode()
        self._check_interrupt()
        self.work.mkdir(parents=True, exist_ok=True)
        self.events.event("upgrade mode", mode=mode, refused=refused)
        if refused:
            self.events.say(f"CPR refused ({refused}): local live migration instead")
        try:
            if mode == "cpr-exec":
                res = await self._cpr_exec()
            elif mode == "save-restore":
                res = await self._save_restore()
            else:
                res = await self._beside(mode)
        finally:
            for fd in self._grabbed:
                with contextlib.suppress(OSError):
                    os.close(fd)
        res.refused = refused
        return res

    # -- cpr-transfer and migrate: a second process beside the old one --------------
    async def _beside(self, mode: str) -> Result:
        main = self.work / "main.sock"
        cprs = self.work / "cpr.sock"
        trace_log = self.work / "new-trace.log"
        for p in (main, cprs, trace_log):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        if mode == "cpr-transfer":
            incoming = ["-incoming", f"unix:{main}", "-incoming", json.dumps(
                {"channel-type": "cpr",
                 "addr": {"transport": "socket", "type": "unix", "path": str(cprs)}})]
        else:
            incoming = ["-incoming", "defer"]
        fds = self._grab_taps()
        argv = procfs.netns_prefix(self.pid) + argvmod.new_argv(
            self.old_argv, str(self.req.to_qemu), incoming, fds, timing.trace_args(trace_log))
        res = Result(outcome="failed", mode=mode, old_pid=self.pid, new_argv=argv)
        if mode == "migrate":
            self._moved = self._sockets_aside()
        logf = open(self.work / "new.log", "wb")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=list(fds.values()))
        except OSError as e:
            journal.put_back_before_switch(self._moved)
            journal.clear(self.work)
            raise VMError(f"cannot run {self.req.to_qemu}: {e.strerror}") from e
        finally:
            logf.close()
        t_started = time.time()
        res.new_proc, res.new_pid = proc, proc.pid
        # a livemig killed from now on leaves two QEMUs: --recover settles them
        journal.write(self.work, self._moved, self.pid, new_pid=proc.pid,
                      qmp=str(self.old.socket_path), phase=journal.SWITCH)
        self.events.event("new qemu started", pid=proc.pid, mode=mode)
        try:
            if self.watch is not None:
                self._tasks.append(asyncio.create_task(self.watch(proc.pid)))
            if mode == "cpr-transfer":
                await self._wait_listening(cprs, proc, "its cpr channel")
                self._check_interrupt()
                await self._transfer(res, main, cprs, proc)
            else:
                await self._migrate(res, proc)
        except (LivemigError, OSError, TimeoutError) as e:
            res.outcome, res.reason = "failed", str(e)
            await self._roll_back(res, proc, trace_log)
            return res
        old_ev = timing.event_times(await self._drain_events(self.old))
        new_tr = timing.parse_trace(_read(trace_log))
        assert res.t_issue is not None
        res.breakdown = timing.breakdown(res.t_issue, old_ev, new_tr, t_started).as_dict()
        res.t_running = new_tr.get("running", res.t_running)
        if self.req.quit_old:
            res.old_exited = await self._quit_old(proc.pid)
        else:
            journal.clear(self.work)
        res.outcome = "completed"
        return res

    async def _transfer(self, res: Result, main: Path, cprs: Path,
                        proc: subprocess.Popen[bytes]) -> None:
        await self._set_events(True)
        await self.old.cmd("migrate-set-parameters", mode="cpr-transfer")
        res.t_issue = time.time()
        await self.old.cmd("migrate", channels=[
            {"channel-type": "main",
             "addr": {"transport": "socket", "type": "unix", "path": str(main)}},
            {"channel-type": "cpr",
             "addr": {"transport": "socket", "type": "unix", "path": str(cprs)}}])
        res.final_stats = await self._wait_source_done(proc)
        res.downtime_ms = res.final_stats.get("downtime")
        res.total_ms = res.final_stats.get("total-time")
        res.new_endpoint = await self._connect_new(proc)
        res.t_running = await self._wait_running(res.new_endpoint, proc)

    async def _migrate(self, res: Result, proc: subprocess.Popen[bytes]) -> None:
        """The fallback: the engine migrates to the new process over a unix socket."""
        new = await self._connect_new(proc)
        res.new_endpoint = new
        for end in (self.old, new):
            await end.cmd("migrate-set-capabilities", capabilities=[
                {"capability": "x-ignore-shared", "state": True}])
        accel = "tcg"
        with contextlib.suppress(VMError):
            if (await self.old.cmd("query-kvm")).get("enabled"):
                accel = "kvm"
        plan = Plan(uri=f"unix:{self.work / 'migrate.sock'}", profile="upstream-plain",
                    verify=False, accel=accel, max_time=SWITCH_TIMEOUT_S * 5).validate()
        res.t_issue = time.time()
        engine = Engine(self.old, new, plan, events=self.events, interrupt=self.interrupt,
                        run_id=f"u{os.getpid()}", guardian_dir=self.work / "guardian")
        # the old QEMU's monitor was moved aside (the new QEMU serves the VM's path):
        # the engine's guardian, should livemig die, must reach it there, not the new
        # QEMU a second time at the VM's path (found by the kill -9 mid-copy case:
        # the guardian's "source" repair went to the new QEMU, the old one stayed paused)
        home = self.old.socket_path
        self.old.socket_path = Path(dict(self._moved).get(str(home), str(home)))
        try:
            rec = await engine.run()
        finally:
            self.old.socket_path = home
        res.final_stats = dict(rec.final_stats)
        if not rec.completed:
            raise VMError(f"local live migration {rec.outcome}: {rec.reason}")
        res.downtime_ms = rec.downtime_ms
        res.total_ms = rec.total_ms
        res.t_running = await self._wait_running(new, proc)

    def _sockets_aside(self) -> list[tuple[str, str]]:
        """The local migration's new QEMU binds the VM's socket paths as it starts,
        unlinking the old QEMU's: after a rollback the old one would be unreachable.
        Its listening sockets named on its command line are moved aside first (the
        journal says so before the first rename); a rollback puts them back, the quit
        replaces them by the new QEMU's while the old one exits."""
        listening = procfs.listening_unix_paths(self.pid)
        named = [p for p in sorted(listening) if any(p in a for a in self.old_argv)]
        moves = [(p, journal.aside(p)) for p in named
                 if os.path.lexists(p) and not os.path.lexists(journal.aside(p))]
        if not moves:
            return []
        journal.write(self.work, moves, self.pid, qmp=str(self.old.socket_path),
                      phase=journal.SWITCH)
        done = []
        for p, aside in moves:
            with contextlib.suppress(OSError):
                os.rename(p, aside)
                done.append((p, aside))
        return done

    def _grab_taps(self) -> dict[str, int]:
        """netdev id -> a duplicate of the old QEMU's open tap, in this process."""
        taps = argvmod.tap_netdevs(self.old_argv)
        if not taps:
            return {}
        open_taps = procfs.tap_fds(self.pid)
        out: dict[str, int] = {}
        for t in taps:
            fd = _which_fd(t, open_taps)
            if fd is None:
                raise VMError(f"netdev {t.id}: no open tap found in pid {self.pid}")
            local = procfs.grab_fd(self.pid, fd)
            self._grabbed.append(local)
            out[t.id] = local
        return out

    async def _wait_listening(self, path: Path, proc: subprocess.Popen[bytes], what: str) -> None:
        # listening, not merely bound: the path appears at bind(), and a connect
        # before the listen() that follows is refused (CI saw the old QEMU's migrate
        # fail so); a probing connect would be taken as the one cpr connection. The
        # path's existence first: the /proc scan of the fds only once it is bound
        deadline = time.monotonic() + START_TIMEOUT_S
        while not path.exists() or str(path) not in procfs.listening_unix_paths(proc.pid):
            if proc.poll() is not None:
                raise VMError(f"the new QEMU exited before it listened on {what}: "
                              f"{_tail(self.work / 'new.log')}")
            if time.monotonic() > deadline:
                raise VMError(f"the new QEMU did not listen on {what} within "
                              f"{START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)

    async def _wait_source_done(self, proc: subprocess.Popen[bytes] | None
                                ) -> dict[str, Any]:
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        while True:
            info = await self.old.cmd("query-migrate")
            st = info.get("status")
            if st == "completed":
                return dict(info)
            if st in ("failed", "cancelled"):
                raise VMError(f"the old QEMU's migration {st}: "
                              f"{info.get('error-desc', 'no reason given')}")
            if proc is not None and proc.poll() is not None:
                raise VMError(f"the new QEMU exited: {_tail(self.work / 'new.log')}")
            if time.monotonic() > deadline:
                raise VMError(f"the switch did not finish within {SWITCH_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)

    async def _connect_new(self, proc: subprocess.Popen[bytes]) -> Endpoint:
        """The new QEMU's monitor: the same socket path, once the new process serves it."""
        path = self.old.socket_path
        deadline = time.monotonic() + START_TIMEOUT_S
        while socket_peer_pid(path) != proc.pid:
            if proc.poll() is not None:
                raise VMError(f"the new QEMU exited: {_tail(self.work / 'new.log')}")
            if time.monotonic() > deadline:
                raise VMError(f"the new QEMU did not serve {path} within "
                              f"{START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)
        return await _connect_retry(path, proc.pid, lambda: proc.poll() is None, deadline)

    async def _wait_running(self, new: Endpoint, proc: subprocess.Popen[bytes] | None
                            ) -> float:
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        while True:
            st = (await new.cmd("query-status")).get("status")
            if st == "running":
                return time.time()
            if proc is not None and proc.poll() is not None:
                raise VMError(f"the new QEMU exited: {_tail(self.work / 'new.log')}")
            if time.monotonic() > deadline:
                raise VMError(f"the new QEMU is {st}, not running, after "
                              f"{SWITCH_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)

    async def _roll_back(self, res: Result, proc: subprocess.Popen[bytes],
                         trace_log: Path) -> None:
        """The new process goes and the old one runs the guest again, unless the new
        one may already have run it: the RAM is shared, so after the guest ran in the
        new QEMU (its rings, its clocks moved on) the old device state is stale and
        resuming the old QEMU would corrupt the guest. Then the new one keeps it."""
        status = None
        with contextlib.suppress(LivemigError):
            status = (await self.old.cmd("query-migrate")).get("status")
        ran = "running" in timing.parse_trace(_read(trace_log))
        if status == "completed" and (proc.poll() is None or ran):
            if proc.poll() is None:
                res.reason = (f"{res.reason}; the new QEMU (pid {proc.pid}) has the guest "
                              "and runs on; the old one is left paused, not resumed")
                res.t_running = res.t_running or time.time()
            else:
                res.reason = (f"{res.reason}; the new QEMU ran the guest and died: the old "
                              "one cannot take it back (its device state is stale)")
                res.new_proc = None
            self.events.event("upgrade failed after the switch", reason=res.reason)
            journal.clear(self.work)  # said in the reason: nothing for --recover
            return
        if res.new_endpoint is not None:
            await res.new_endpoint.close()
            res.new_endpoint = None
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        res.new_proc = None
        journal.put_back_before_switch(self._moved)
        self._moved = []
        journal.clear(self.work)
        with contextlib.suppress(LivemigError):
            await self.old.cmd("migrate-set-parameters", mode="normal")
        with contextlib.suppress(LivemigError):
            await self._set_events(False)
        with contextlib.suppress(LivemigError):
            st = (await self.old.cmd("query-status")).get("status")
            if st != "running":
                await self.old.cmd("cont")
                self.events.say(f"upgrade failed: the old QEMU resumed the guest (was {st})")
        self.events.event("upgrade rolled back", reason=res.reason)

    async def _quit_old(self, new_pid: int | None) -> bool:
        """Tell the old QEMU to quit; keep the sockets the new one now serves."""
        shared: set[str] = set()
        if new_pid is not None:
            shared = procfs.listening_unix_paths(new_pid) & procfs.listening_unix_paths(
                self.pid)
        moved: list[tuple[str, str]] = []
        moves = [(p, journal.aside(p)) for p in sorted(shared)]
        if moves:  # before the first rename: a livemig killed now leaves a way back
            journal.write(self.work, moves, self.pid)
        for p, aside in moves:
            with contextlib.suppress(OSError):
                os.rename(p, aside)
                moved.append((p, aside))
        try:
            with contextlib.suppress(LivemigError):
                await asyncio.wait_for(self.old.cmd("quit"), 5.0)
            await self.old.close()
            deadline = time.monotonic() + OLD_EXIT_TIMEOUT_S
            while procfs.alive(self.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            back = 0
            for p, aside in moved:
                with contextlib.suppress(OSError):
                    os.rename(aside, p)
                    back += 1
            if back == len(moved):
                journal.clear(self.work)
        gone = not procfs.alive(self.pid)
        self.events.event("old qemu quit", pid=self.pid, exited=gone, sockets_kept=len(moved))
        return gone

    # -- save to a file, quit, restore: the baseline CPR replaces --------------------
    async def _save_restore(self) -> Result:
        """``stop``, all of RAM and the device state to a file, the old QEMU quits, the
        new one loads the file and the guest runs again (what ``virsh save`` +
        ``virsh restore`` do). The open tap is held by livemig in between."""
        state = self.work / "vm.state"
        trace_log = self.work / "new-trace.log"
        for p in (state, trace_log):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        fds = self._grab_taps()
        argv = procfs.netns_prefix(self.pid) + argvmod.new_argv(
            self.old_argv, str(self.req.to_qemu), ["-incoming", f"file:{state}"], fds,
            timing.trace_args(trace_log))
        res = Result(outcome="failed", mode="save-restore", old_pid=self.pid, new_argv=argv)
        await self._set_events(True)
        res.t_issue = time.time()
        try:
            await self.old.cmd("stop")
            await self.old.cmd("migrate", uri=f"file:{state}")
            res.final_stats = await self._wait_source_done(None)
        except LivemigError as e:
            res.reason = str(e)
            with contextlib.suppress(LivemigError):
                await self.old.cmd("cont")
            return res
        old_ev = timing.event_times(await self._drain_events(self.old))
        res.old_exited = await self._quit_old(None)
        logf = open(self.work / "new.log", "wb")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=list(fds.values()))
        finally:
            logf.close()
        res.new_proc, res.new_pid = proc, proc.pid
        if self.watch is not None:
            self._tasks.append(asyncio.create_task(self.watch(proc.pid)))
        try:
            new = await self._connect_new(proc)
            res.new_endpoint = new
            deadline = time.monotonic() + SWITCH_TIMEOUT_S
            while (await new.cmd("query-migrate")).get("status") != "completed":
                if time.monotonic() > deadline:
                    raise VMError("the new QEMU did not load the saved state")
                await asyncio.sleep(POLL_S)
            await new.cmd("cont")
            res.t_running = await self._wait_running(new, proc)
        except LivemigError as e:
            res.reason = f"{e} (the old QEMU has quit: the guest is only in {state})"
            return res
        new_tr = timing.parse_trace(_read(trace_log))
        res.breakdown = timing.breakdown(res.t_issue, old_ev, new_tr).as_dict()
        res.downtime_ms = res.final_stats.get("downtime")
        res.total_ms = res.final_stats.get("total-time")
        res.outcome = "completed"
        with contextlib.suppress(FileNotFoundError):
            state.unlink()
        return res

    # -- cpr-exec: the old process becomes the new one -------------------------------
    async def _cpr_exec(self) -> Result:
        state = self.work / "vm.state"
        trace_log = self.work / "new-trace.log"
        for p in (state, trace_log):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        taps = argvmod.tap_netdevs(self.old_argv)
        open_taps = procfs.tap_fds(self.pid)
        fds: dict[str, int] = {}
        for t in taps:
            name = next((n for n, (fd, _) in open_taps.items() if fd == _which_fd(t, open_taps)),
                        None)
            if name is None:
                raise VMError(f"netdev {t.id}: no open tap found in pid {self.pid}")
            fd, cloexec = open_taps[name]
            if cloexec:
                raise Refused(f"cannot upgrade in place with cpr-exec: tap {name} is "
                              "closed on exec (use --mode cpr-transfer)")
            fds[t.id] = fd  # the same number: it survives the exec
        argv = argvmod.new_argv(self.old_argv, str(self.req.to_qemu),
                                ["-incoming", f"file:{state}"], fds,
                                timing.trace_args(trace_log))
        res = Result(outcome="failed", mode="cpr-exec", old_pid=self.pid, new_pid=self.pid,
                     new_argv=argv)
        self._check_interrupt()
        await self._set_events(True)
        await self.old.cmd("migrate-set-parameters", mode="cpr-exec", **{
            "cpr-exec-command": argv})
        res.t_issue = time.time()
        try:
            await self.old.cmd("migrate", channels=[
                {"channel-type": "main",
                 "addr": {"transport": "file", "filename": str(state), "offset": 0}}])
            if self.watch is not None:
                self._tasks.append(asyncio.create_task(self.watch(self.pid)))
            res.final_stats = await self._wait_exec()
        except LivemigError as e:
            res.reason = str(e)
            await self._after_exec_failure(res)
            return res
        events = await self._drain_events(self.old)
        await self.old.close()
        try:
            new = await _connect_retry(self.old.socket_path, self.pid,
                                       lambda: procfs.alive(self.pid),
                                       time.monotonic() + START_TIMEOUT_S)
            res.new_endpoint = new
            res.t_running = await self._wait_running(new, None)
        except LivemigError as e:
            res.reason = (f"{e} (after exec: the VM cannot be put back; pid {self.pid} "
                          f"{'runs' if procfs.alive(self.pid) else 'is gone'})")
            return res
        with contextlib.suppress(FileNotFoundError):
            state.unlink()
        new_tr = timing.parse_trace(_read(trace_log))
        res.breakdown = timing.breakdown(res.t_issue, timing.event_times(events),
                                         new_tr).as_dict()
        res.t_running = new_tr.get("running", res.t_running)
        res.downtime_ms = res.final_stats.get("downtime")
        res.total_ms = res.final_stats.get("total-time")
        res.old_exited = True  # exec replaced the old image (same pid)
        res.outcome = "completed"
        self.events.event("cpr-exec done", pid=self.pid, exe=procfs.exe(self.pid))
        return res

    async def _wait_exec(self) -> dict[str, Any]:
        """Until the old image is gone (its QMP connection closes at exec)."""
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        last: dict[str, Any] = {}
        while True:
            try:
                info = await self.old.cmd("query-migrate")
            except VMError as e:
                if "connection lost" in str(e) or "disconnect" in str(e).lower():
                    if not procfs.alive(self.pid):
                        raise VMError("QEMU died during cpr-exec") from e
                    return last
                raise
            last = dict(info)
            if info.get("status") in ("failed", "cancelled"):
                raise VMError(f"cpr-exec {info['status']}: "
                              f"{info.get('error-desc', 'no reason given')}")
            if time.monotonic() > deadline:
                raise VMError(f"cpr-exec did not happen within {SWITCH_TIMEOUT_S:.0f}s")
            await asyncio.sleep(POLL_S)

    async def _after_exec_failure(self, res: Result) -> None:
        """exec() did not happen: QEMU resumed the guest itself; make sure."""
        if not procfs.alive(self.pid):
            res.reason = f"{res.reason} (QEMU pid {self.pid} is gone)"
            return
        with contextlib.suppress(LivemigError):
            await self.old.cmd("migrate-set-parameters", mode="normal")
            st = (await self.old.cmd("query-status")).get("status")
            if st != "running":
                await self.old.cmd("cont")

    # -- helpers --------------------------------------------------------------------
    async def _set_events(self, on: bool) -> None:
        await self.old.cmd("migrate-set-capabilities", capabilities=[
            {"capability": "events", "state": on}])

    async def _drain_events(self, end: Endpoint) -> list[dict[str, Any]]:
        """Every event the end sent so far (qemu.qmp keeps a history)."""
        await asyncio.sleep(0)
        if end.qmp is None:
            return []
        return [dict(ev) for ev in end.qmp.events.history]


async def _connect_retry(path: Path, pid: int, alive: Callable[[], bool],
                         deadline: float) -> Endpoint:
    """QMP of a QEMU that is starting: a connection refused, or cut while the old
    image goes (cpr-exec), means "not yet"."""
    while True:
        new = Endpoint("new", path, pid=pid, alive=alive)
        try:
            await new.connect(max(1.0, deadline - time.monotonic()))
            return new
        except VMError:
            await new.close()
            if not alive() or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


def _which_fd(t: argvmod.TapNetdev, open_taps: dict[str, tuple[int, bool]]) -> int | None:
    if t.ifname and t.ifname in open_taps:
        return open_taps[t.ifname][0]
    if t.fd is not None and any(fd == t.fd for fd, _ in open_taps.values()):
        return t.fd
    if len(open_taps) == 1 and not t.ifname:
        return next(iter(open_taps.values()))[0]
    return None


def _refusal(blockers: list[str], argv: list[str]) -> str:
    """One line: QEMU's first reason, with what livemig sees in the command line."""
    first = blockers[0].rstrip(".")
    more = f" (+{len(blockers) - 1} more)" if len(blockers) > 1 else ""
    backends = argvmod.ram_backends(argv)
    if not backends:
        hint = "guest RAM is anonymous (plain -m): CPR needs a memory backend with share=on"
    elif not all(b.get("share") == "on" for b in backends):
        hint = "a memory backend lacks share=on"
    elif "aux-ram-share=on" not in " ".join(argv):
        hint = "the VM was started without -machine aux-ram-share=on"
    else:
        hint = ""
    return f"{hint + ': ' if hint else ''}{first}{more}"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = 3) -> str:
    return " | ".join(_read(path).strip().splitlines()[-lines:]) or "(no output)"


__all__ = ["MODES", "Refused", "Request", "Result", "Upgrade", "cpr_blockers"]
