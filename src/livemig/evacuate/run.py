"""Running an evacuation: the scheduler's actions carried out, one child
``livemig migrate --domain`` per VM.

Each VM's migration is the existing entry point in a child process: its own guardian,
journal, policies, verification and report (``DIR/<name>.json``, log
``DIR/<name>.log``), so a crash of one cannot take the others or this process with it,
and a ``kill -9`` of ``livemig evacuate`` leaves the children finishing (or, each with
its guardian, leaving its guest on the source). This process reads the source
domains' libvirt job statistics for the live view and the re-plan, and changes a
running migration's cap with ``virDomainMigrateSetMaxSpeed``.

Who owns the cap: the child is started with ``--bandwidth`` = its share; with the
shared storage of a ``--storage shared`` evacuation none of the child's policies
sets the RAM bandwidth (only the disk-share policy does, while a disk copy runs), so
this process is the only one that changes it afterwards. With ``--storage copy`` the
child's disk policy splits its own cap between the mirror and RAM: the caps are set
at start only, never re-shared.

Cancel (Ctrl-C, SIGTERM, ``--max-time``): SIGINT to every child (each aborts its
libvirt job: its guest keeps running on the source), nothing queued starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from livemig.evacuate import schedule
from livemig.evacuate.pool import Pool
from livemig.evacuate.schedule import MIGRATING, QUEUED, VmFacts, VmState
from livemig.sampling import given
from livemig.virt.conn import libvirt_module
from livemig.virt.plan import MIGRATIONS_AT_ONCE_ENV, STOCK_FOUND_ENV, STOCK_PEER_ENV

# what a child's environment gets from the evacuation, per VM, never inherited
CHILD_ENV = (given.ENV, STOCK_PEER_ENV, STOCK_FOUND_ENV, MIGRATIONS_AT_ONCE_ENV)

POLL_S = 0.5
EXIT_POLL_S = 0.05  # how soon a child's exit is seen between polls (a waitpid each)
RETRY_DELAY_S = 2.0  # a failed VM waits this long before its second try
ATTEMPTS = 2  # a failed migration is retried once
ABORT_WAIT_S = 60.0  # children get this long to abort their jobs after a cancel
DONE, FAILED, ABORTED, SKIPPED = "done", "failed", "aborted", "skipped"
JOB_NONE = 0  # VIR_DOMAIN_JOB_NONE: jobStats' type when no job runs


@dataclass
class Vm:
    facts: VmFacts
    destination: str  # URI
    status: str = QUEUED
    attempts: int = 0
    bandwidth: float | None = None
    started: float | None = None  # seconds since the evacuation began
    ended: float | None = None
    not_before: float = 0.0
    proc: subprocess.Popen[bytes] | None = None
    live: dict[str, Any] = field(default_factory=dict)  # last jobStats view
    reports: list[dict[str, Any]] = field(default_factory=list)
    tries: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    left_source: bool = False  # failed, yet no longer runs on the source (see _poll)
    sample_file: Path | None = None  # the measurement's page sample, for the child
    # this try's stream, seconds since the evacuation began: its first byte (libvirt's
    # job has RAM or disk processed) and its last (no RAM left: the switchover; or the
    # job gone). libvirt's job lasts through the destination's finish and the confirm
    first_byte: float | None = None
    last_byte: float | None = None
    stream: tuple[float, float] | None = None  # the completed try's first and last byte

    @property
    def name(self) -> str:
        return self.facts.name


@dataclass
class Options:
    src_uri: str
    profile: str
    out: Path
    links: dict[str, float]
    max_parallel: int
    max_time: float | None
    per_link: int | None = None  # streams holding each link at once (schedule.Snapshot)
    storage: str = "shared"
    sets: list[str] = field(default_factory=list)
    quiet: bool = False
    reshare: bool = True
    unsafe: bool = False
    # "livemig" (schedule.decide) or "fixed:N" (a baseline: N at a time in the given
    # order, no caps, TCP splits the link: what Nova and KubeVirt do)
    scheduler: str = "livemig"
    # destinations known to run a stock QEMU, and how it is known (the doctor's probe);
    # an evacuation adds those a child had to retry toward (run.Evacuation.stock)
    stock: dict[str, str] = field(default_factory=dict)

    @property
    def fixed(self) -> int | None:
        return fixed_concurrency(self.scheduler)


def fixed_concurrency(scheduler: str) -> int | None:
    """N of a ``fixed:N`` scheduler, None for livemig's."""
    return int(scheduler.split(":", 1)[1]) if scheduler.startswith("fixed:") else None


def warm_pool(vms: int, max_parallel: int, fixed: int | None) -> Pool:
    """Warm children for the first wave (``max_parallel``, or N of ``fixed:N``),
    whose environment names no page sample and no stock destination (each VM's own
    is passed to its child)."""
    return Pool(min(vms, max(1, max_parallel, fixed or 0)),
                {k: v for k, v in os.environ.items() if k not in CHILD_ENV})


class Evacuation:
    def __init__(self, opts: Options, vms: list[Vm], src_conn: Any,
                 view: Any = None, pool: Pool | None = None) -> None:
        self.o = opts
        self.vms = vms
        self.conn = src_conn
        self.view = view
        self.cancelled = ""
        self.t0 = time.monotonic()
        self.started_at = time.time()  # the drain's first start, seconds since the epoch
        self.events: list[dict[str, Any]] = []
        # warm children: the caller's (warming since before the measurement), else
        # the first wave's
        self.pool = pool or warm_pool(len(vms), opts.max_parallel, opts.fixed)
        # (before its stream, after it) of every migration that completed here
        self.overheads: list[tuple[float, float]] = []
        # destinations known to run a stock QEMU, and how: the doctor's probe, else
        # the first child that had to retry toward one (the VMs started after it
        # skip the refused first attempt)
        self.stock = dict(opts.stock)

    def overhead(self) -> schedule.Overhead:
        """What a migration costs here beyond its bytes, once one has completed: the
        medians of the completed ones (the live view's ETA, the report), else the
        model's."""
        if not self.overheads:
            return schedule.MODELLED
        return schedule.Overhead(statistics.median(p for p, _ in self.overheads),
                                 statistics.median(q for _, q in self.overheads))

    def t(self) -> float:
        return time.monotonic() - self.t0

    def cancel(self, why: str) -> None:
        if not self.cancelled:
            self.cancelled = why
            self.event("cancel", reason=why)
            for v in self.vms:
                if v.proc is not None and v.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        v.proc.send_signal(signal.SIGINT)

    def event(self, what: str, **kw: Any) -> None:
        self.events.append({"t": round(self.t(), 3), "event": what, **kw})

    def run(self) -> None:
        self.t0 = time.monotonic()  # --max-time counts the drain, from its first start
        self.started_at = time.time()
        self.o.out.mkdir(parents=True, exist_ok=True)
        for u, how in self.stock.items():  # the doctor's word; learnt ones come later
            self.event("stock destination", destination=u, how=how)
        try:
            self._drain()
        finally:
            self.pool.close()
        for v in self.vms:
            if v.status == QUEUED:
                v.status = ABORTED if self.cancelled else SKIPPED
                v.reason = self.cancelled or v.reason

    def _drain(self) -> None:
        cancel_at = None
        while True:
            now = self.t()
            if self.o.max_time is not None and now > self.o.max_time and not self.cancelled:
                self.cancel(f"--max-time {self.o.max_time:g} s reached")
                cancel_at = time.monotonic()
            if self.cancelled and cancel_at is None:
                cancel_at = time.monotonic()
            for v in self.vms:
                if v.status == MIGRATING:
                    self._poll(v)
            if not self.cancelled:
                self._act(now)
            if self.view is not None:
                self.view.show(self)
            running = [v for v in self.vms if v.status == MIGRATING]
            waiting = [v for v in self.vms if v.status == QUEUED]
            if not running and (not waiting or self.cancelled):
                break
            if not running and all(v.not_before <= now for v in waiting):
                # nothing runs and the scheduler started none of them: it never will
                # (a bug in the rule); report them rather than wait to --max-time
                for v in waiting:
                    v.reason = "the scheduler never started it"
                break
            if cancel_at is not None and time.monotonic() - cancel_at > ABORT_WAIT_S:
                for v in running:  # a child that ignores SIGINT: its guardian cleans up
                    if v.proc is not None:
                        v.proc.kill()
            if not self.cancelled:  # a child warms for each VM that may start next
                self.pool.fill(len(waiting))
            self._nap(POLL_S)

    def _nap(self, seconds: float) -> None:
        """Sleep until the next poll, or until a running child exits: its VM's end
        (and the start of what waits for it) is seen within ``EXIT_POLL_S``, not up to
        a whole ``POLL_S`` later (half a second per VM on the critical path)."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            if any(v.proc is not None and v.proc.poll() is not None for v in self.vms
                   if v.status == MIGRATING):
                return
            time.sleep(min(EXIT_POLL_S, left))

    def _act(self, now: float) -> None:
        states = []
        for v in self.vms:
            status = v.status if v.status in (QUEUED, MIGRATING) else schedule.DONE
            if v.status == QUEUED and now < v.not_before:
                status = schedule.DONE  # waits for its retry: not the scheduler's yet
            states.append(VmState(v.facts, status, v.bandwidth, progress(v.live),
                                  sending=not v.live.get("sent"), tail_s=tail(v.live)))
        snap = schedule.Snapshot(now, tuple(states), self.o.links, self.o.max_parallel,
                                 self.o.per_link)
        by_name = {v.name: v for v in self.vms}
        n = self.o.fixed
        for a in (schedule.decide(snap) if n is None else schedule.fixed(n)(snap)):
            v = by_name[a.name]
            if isinstance(a, schedule.Start):
                self._start(v, a.bandwidth, a.reason, a.expected or a.bandwidth)
            elif self.o.reshare and n is None:
                self._set_speed(v, a.bandwidth, a.reason)

    def _start(self, v: Vm, bandwidth: float, reason: str, expected: float) -> None:
        v.attempts += 1
        v.status, v.bandwidth = MIGRATING, bandwidth
        if v.started is None:
            v.started = self.t()
        report = self.o.out / f"{v.name}{'' if v.attempts == 1 else f'.try{v.attempts}'}.json"
        log = self.o.out / f"{v.name}.log"
        cmd = ["migrate", "--domain", v.name,
               "--connect", self.o.src_uri, "--to", v.destination,
               "--profile", self.o.profile, "--storage", self.o.storage,
               "--report", str(report), "-q"]
        if self.o.fixed is None:  # a fixed concurrency caps nothing, as Nova and KubeVirt
            cmd += ["--bandwidth", f"{mib(bandwidth)}M"]
        if not any(x.startswith("link-rate=") for x in self.o.sets):
            # the encoding model's rate: its share beside the others, not the cap (a
            # child told nothing models an unshaped 10 Gbit/s link: livemig's profile
            # at fixed:1 then sent plain pages over 100 Mbit/s, 2.9x the bytes)
            cmd += ["--set", f"link-rate={link_rate(expected)}"]
        if self.o.unsafe:
            cmd.append("--unsafe")
        for s in self.o.sets:
            cmd += ["--set", s]
        if self.o.max_time is not None:
            cmd += ["--max-time", f"{max(1.0, self.o.max_time - self.t() + 5):.0f}"]
        # the delta caches of the migrations that run at once share the source's memory
        env = {MIGRATIONS_AT_ONCE_ENV: str(max(1, self.o.fixed or self.o.max_parallel))}
        if v.sample_file is not None:  # the child reuses it while it is fresh
            env[given.ENV] = str(v.sample_file)
        if v.destination in self.stock:
            env[STOCK_PEER_ENV] = self.stock[v.destination]
        else:  # where its child says, at once, that the destination refused its first try
            env[STOCK_FOUND_ENV] = str(self._found(v))
        with open(log, "ab") as f:
            f.write(f"$ livemig {' '.join(cmd)}\n".encode())
        cold = self.pool.cold
        v.proc = self.pool.run(cmd, log, env, list(CHILD_ENV))
        v.tries.append({"attempt": v.attempts, "t": round(self.t(), 3), "report": str(report),
                        "bandwidth": round(bandwidth), "expected": round(expected),
                        "sample_given": v.sample_file is not None,
                        "warm": self.pool.cold == cold})
        self.event("start", vm=v.name, attempt=v.attempts, destination=v.destination,
                   bandwidth=round(bandwidth), expected=round(expected), reason=reason)

    def _set_speed(self, v: Vm, bandwidth: float, reason: str) -> None:
        try:
            dom = self.conn.lookupByName(v.name)
            dom.migrateSetMaxSpeed(mib(bandwidth), 0)
        except Exception as e:  # the job may just have ended: keep going
            self.event("bandwidth not changed", vm=v.name, error=" ".join(str(e).split()))
            return
        v.bandwidth = bandwidth
        self.event("bandwidth", vm=v.name, bandwidth=round(bandwidth), reason=reason)

    def _poll(self, v: Vm) -> None:
        assert v.proc is not None
        rc = v.proc.poll()
        self._learn_stock(v)  # while the child runs: the VMs started meanwhile are told
        if rc is None:
            self._live(v)
            return
        report = Path(v.tries[-1]["report"])
        rep: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            rep = json.loads(report.read_text())
        v.reports.append(rep)
        v.tries[-1].update(exit=rc, outcome=rep.get("outcome"), end=round(self.t(), 3))
        v.proc, v.live = None, {}
        first, last = v.first_byte, v.last_byte
        v.first_byte = v.last_byte = None  # a retry streams again
        if rc == 0 and rep.get("outcome") == "completed":
            v.status, v.ended = DONE, self.t()
            if first is not None and last is not None:
                v.stream = (first, last)
                self.overheads.append((first - float(v.tries[-1]["t"]), v.ended - last))
            self.event("verified", vm=v.name, ram=rep.get("consistency", {}).get("ram"))
            return
        v.reason = str(rep.get("reason") or f"livemig migrate exited {rc} (log "
                       f"{self.o.out / (v.name + '.log')})")
        if self.cancelled:
            v.status, v.ended = ABORTED, self.t()
        elif not self._runs_on_source(v):
            # libvirt's peer-to-peer job can complete after the child failed (its
            # destination daemon went away during the confirm): the guest runs on the
            # destination, unverified; a retry would only fail to find it here
            v.status, v.ended, v.left_source = FAILED, self.t(), True
            v.reason = (f"no longer runs on the source after try {v.attempts} ({v.reason}): "
                        f"look for it on {v.destination} (not verified there)")
            self.event("failed", vm=v.name, reason=v.reason, left_source=True)
        elif v.attempts < ATTEMPTS:
            v.status, v.bandwidth, v.not_before = QUEUED, None, self.t() + RETRY_DELAY_S
            self.event("retry", vm=v.name, reason=v.reason)
        else:
            v.status, v.ended = FAILED, self.t()
            self.event("failed", vm=v.name, reason=v.reason)

    def _found(self, v: Vm) -> Path:
        return self.o.out / f"{v.name}.try{v.attempts}.stock"

    def _learn_stock(self, v: Vm) -> None:
        """A child whose first attempt the destination's QEMU refused (it wrote the
        refused property to :meth:`_found` before its retry): the VMs started toward
        that destination from now on start as its retry does."""
        if v.destination in self.stock:
            return
        try:
            refused = self._found(v).read_text().strip()
        except OSError:  # nothing refused (or not yet)
            return
        if not refused:  # being written
            return
        how = f"{v.name}'s first attempt: it has no {refused}"
        self.stock[v.destination] = how
        self.event("stock destination", destination=v.destination, how=how)

    def _runs_on_source(self, v: Vm) -> bool:
        """The domain is still active on the source (True when it cannot be told)."""
        libvirt = libvirt_module()
        try:
            return bool(self.conn.lookupByName(v.name).isActive())
        except Exception as e:  # no such domain (it left); else it cannot be told
            return not (isinstance(e, libvirt.libvirtError)
                        and e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN)

    def _live(self, v: Vm) -> None:
        """The source's job statistics: the view, a re-plan when the VM dirties more
        than measured before, and the end of its stream: once libvirt's job has been
        seen and is gone, the child is only finishing (the destination's resume,
        confirm, the check, the report: 1.3-4.4 s measured) and its part of the
        link goes to the others at once instead of when the child exits."""
        try:
            stats = self.conn.lookupByName(v.name).jobStats()
        except Exception:  # the domain just left (undefined on the source)
            self._sent(v)
            return
        if int(stats.get("type") or 0) == JOB_NONE:
            self._sent(v)
            return
        processed = int(stats.get("memory_processed") or 0)
        if v.first_byte is None and (processed or int(stats.get("disk_processed") or 0)):
            v.first_byte = self.t()
        if v.last_byte is None and processed and not int(stats.get("memory_remaining") or 0):
            v.last_byte = self.t()  # the switchover: libvirt's job lasts until confirm
        page = int(stats.get("memory_page_size") or 4096)
        dirty = float(stats.get("memory_dirty_rate") or 0) * page
        v.live = {"job": True, "rounds": int(stats.get("memory_iteration") or 0),
                  "remaining": int(stats.get("memory_remaining") or 0),
                  "total": int(stats.get("memory_total") or 0),
                  "bps": float(stats.get("memory_bps") or 0), "dirty": dirty}
        if dirty > v.facts.dirty_rate * 1.2 and v.live["rounds"] >= 2:
            self.event("busier than measured", vm=v.name, dirty_rate=round(dirty),
                       measured=round(v.facts.dirty_rate))
            v.facts = replace(v.facts, dirty_rate=dirty)

    def _sent(self, v: Vm) -> None:
        """libvirt's job, once seen streaming, is gone: the stream has ended. A job
        gone before its first byte is an attempt that failed at its start (a
        destination QEMU that refused the patched build's settings): the child's
        retry streams next, and the child's exit ends the VM if it does not."""
        if v.live.get("job") and not v.live.get("sent") and v.first_byte is not None:
            v.live["sent"] = True
            if v.last_byte is None:
                v.last_byte = self.t()


def progress(live: dict[str, Any]) -> float:
    """Share of a running migration done, from the source's job statistics: the link
    is shared by what each VM still has to send, not by what it had at the start."""
    total = live.get("total") or 0
    if not total:
        return 0.0
    return min(1.0, max(0.0, 1.0 - float(live.get("remaining") or 0) / total))


def tail(live: dict[str, Any]) -> float | None:
    """Seconds a running migration's stream should still take, from the source's job
    statistics: what is left to send over the rate it sends at. Guest bytes over wire
    bytes/s: compressed or zero pages make it read long, never short (a stream is
    taken as ending late rather than early). None before the job's first figures."""
    bps = float(live.get("bps") or 0)
    if not live.get("job") or live.get("sent") or bps <= 0:
        return None
    return float(live.get("remaining") or 0) / bps


def mib(bytes_per_s: float) -> int:
    """libvirt's cap is whole MiB/s: rounded up, never 0 (= unlimited)."""
    return max(1, math.ceil(bytes_per_s / 2**20))


def link_rate(bytes_per_s: float) -> str:
    """``--set link-rate=`` for a child: bytes/s as Mbit/s, at least 1 (the setting's
    least)."""
    return f"{max(1.0, bytes_per_s * 8 / 1e6):.1f}mbit"
