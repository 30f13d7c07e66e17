"""What a user with a hand-started VM gets: `livemig migrate --src-qmp --dst-qmp` on two
plain QEMUs, stock profiles on the unpatched build against livemig (issue #20's table).

Each run starts two QEMUs with a plain command line (``tests/qemuhelp.py``'s
``start_qemu``: anonymous RAM, the guest image's kernel and initramfs, the workload on
the kernel command line, the agent's port on a socket chardev only this benchmark
reads; nothing of livemig's lab or testbed), the destination with ``-incoming defer
-S`` and the same devices. Once the guest's workload is ready and has run a warm-up
(its normal rate), the benchmark runs, as a user would::

    python -m livemig.cli migrate --src-qmp SRC --dst-qmp DST --uri tcp:127.0.0.1:PORT \\
        --bandwidth 50M --profile P --report R.json -q

and keeps reading the guest agent of both QEMUs (the destination's after the
switchover) until a few seconds after livemig exits; then both QEMUs are stopped.

Configurations (interleaved within each repeat, so host noise hits all alike):
``upstream`` and ``upstream-xbzrle`` on the UNPATCHED build (build/qemu-upstream),
``livemig`` on the PATCHED build (build/qemu), ``livemig@stock`` = profile livemig on
the unpatched build.

Families (1 GiB guest by default):
  records  a table of 128-byte records updated flat out, 80 % of writes in 10 %
  pages    whole-page rewrites at 80 MiB/s of compressible data (70 % in 20 %)

Per run, from livemig's report: outcome, total_time_s, ram_transferred_bytes,
downtime_ms, verify_hold_ms and ``encoding`` (what was sampled, chosen, why). The
tables' time is what the user waits: from the command's start (livemig's page sample
and settings included) to QEMU's completion, i.e. ``total_time_s`` (QEMU's, from
``migrate`` on) plus the time before ``migrate``. From the
agent (host arrival times, ``livemig.metrics``): the normal rate over the warm-up (6 s
after ``ready``, its first second, the workload's ramp, left out); work
lost, seconds below 10 % and 50 % of normal, from the moment the command starts (its
page sampling included) to 2 s after the destination resumed (the lab's settle); the
same from ``migrate`` on (the lab's window, ``work_lost_migration_s``), and what was
lost before it (sampling, setup) and during the RAM-comparison hold; the longest gap
between agent lines (heartbeats every 10 ms, rate lines every 100 ms) = guest pause,
and the longest around the switchover. ``work_lost_s`` (livemig's metric) clips each
100 ms bin at normal, so the normal rate's own noise adds to it: ``noise_s`` is what
the same guest "lost" per second of its warm-up times the judged window (the part of
``work_lost_s`` a guest undisturbed by the migration would show), and
``work_lost_net_s`` the unclipped figure (window - work done / normal rate).
Cross-checks kept in each run: the guest's rate against the spec's, its rate while
QEMU throttled it against ``100 - throttle %`` (the report's timeline), the longest
gap against QEMU's downtime, and that the destination's agent was heard after the
switchover.

Output in ``--out DIR``: ``runs/FAMILY-CONFIG-N.json`` (one run: the figures, the
agent's rate trace, the report's essentials) and ``runs/...report.json`` (livemig's
report) and ``.log`` (its output), ``handstarted.json`` (every run, the medians) and
``summary.md`` (issue #20's table: per family the best stock configuration = most
completed runs, then shortest median time among ``upstream``/``upstream-xbzrle``, and
livemig and livemig@stock against it; then a table per family with every
configuration's medians and ratios, and each run on one line with what makes it
suspect, if anything).

Run it as root in a built tree (``make qemu qemu-upstream guest``). A run takes about
30-45 s on 2 cores (boot, 6 s warm-up, the migration, 3 s tail), so the full 3 repeats
x 4 configurations x 2 families about 15 minutes. On a shared machine take the VM
lock one repeat at a time (``--resume`` keeps what is done; ``--repeats N`` runs
repeats 1..N, so the interleaving is kept)::

    for n in 1 2 3; do
        flock /tmp/livemig-vm.lock python3 bench/handstarted.py --repeats $n --out DIR --resume
    done
    python3 bench/handstarted.py --repeats 1 --out DIR --families pages \\
        --configs upstream,livemig        # a smaller run
    python3 bench/handstarted.py --out DIR --summarize   # the tables again, from the
                                                         # kept traces and reports

A guest shaped otherwise: ``--memory 6G --vcpus 2 --machine pc``; ``--bandwidth none``
passes no ``--bandwidth``, so every profile runs under the QEMU's own ``max-bandwidth``
(128 MiB/s unless set), as a user who gives nothing does
(docs/results/handstarted-2026-11-29d).

(``PYTHONPATH=src`` or the project's venv, so that ``livemig`` imports; the migration
runs ``python -m livemig.cli`` of the same checkout.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import livemig  # noqa: E402
from conftest import INITRD, KERNEL  # noqa: E402
from livemig import metrics  # noqa: E402
from livemig.errors import UsageError  # noqa: E402
from livemig.spec import parse_workload  # noqa: E402
from livemig.units import parse_size  # noqa: E402
from qemuhelp import free_port, start_qemu, stop  # noqa: E402

PATCHED = ROOT / "build" / "qemu" / "qemu-system-x86_64"
STOCK = ROOT / "build" / "qemu-upstream" / "qemu-system-x86_64"

FAMILIES: dict[str, tuple[str, str]] = {
    "records": ("mem:size=256M,rate=0,hot=80/10,touch=128",
                "a table of 128-byte records updated flat out (80 % of writes in 10 %)"),
    "pages": ("mem:size=256M,rate=80M,hot=70/20,touch=4096,fill=mixed",
              "whole-page rewrites at 80 MiB/s, compressible (70 % of writes in 20 %)"),
}
# configuration -> (livemig profile, runs on the unpatched build)
CONFIGS: dict[str, tuple[str, bool]] = {
    "upstream": ("upstream", True),
    "upstream-xbzrle": ("upstream-xbzrle", True),
    "livemig": ("livemig", False),
    "livemig@stock": ("livemig", True),
    # the patched build sampling before `migrate`, as before patch 0012 (an ablation:
    # not in the default set)
    "livemig-sample-first": ("livemig", False),
    # stock multifd zstd at zstd's own default level (3) instead of QEMU's (1): how much
    # a higher level alone gains (an ablation: not in the default set)
    "upstream-zstd3": ("upstream", True),
    # the patched build with lz4-delta forced: no sample, a first pass of lz4 (an
    # ablation: not in the default set)
    "livemig-lz4delta": ("livemig", False),
    # the stock profile on the patched build: what the patches alone cost or save
    # with stock's settings (an ablation: not in the default set)
    "upstream@patched": ("upstream", False),
    # livemig with QEMU's own switchover estimate instead of avail-switchover-bandwidth,
    # on either build (ablations: not in the default set)
    "livemig-nosbw": ("livemig", False),
    "livemig@stock-nosbw": ("livemig", True),
    # livemig on the unpatched build with the encoding given (no page sample): what
    # the engine's rounds cost or save without the sample (an ablation)
    "livemig@stock-zstd": ("livemig", True),
    # the patched build at the source, the unpatched one at the destination (a host
    # not yet upgraded): what the source's own mechanisms give (not in the default set)
    "livemig@mixed": ("livemig", False),
}
# configurations whose destination runs the unpatched build whatever the source runs
TO_STOCK = frozenset({"livemig@mixed"})
# the configurations a run has unless --configs says otherwise
DEFAULT_CONFIGS = ("upstream", "upstream-xbzrle", "livemig", "livemig@stock")
# what a configuration adds to livemig's command line
CONFIG_SETS = {"livemig-sample-first": ("x-multifd-compression-switch=off",),
               "upstream-zstd3": ("multifd-zstd-level=3",),
               "livemig-lz4delta": ("encoding=lz4-delta",),
               "livemig-nosbw": ("switchover-bandwidth=off",),
               "livemig@stock-nosbw": ("switchover-bandwidth=off",),
               "livemig@stock-zstd": ("encoding=zstd",)}
STOCK_CONFIGS = ("upstream", "upstream-xbzrle")  # the baselines

READY_TIMEOUT_S = 240.0  # boot under TCG plus filling the workload's region
WARMUP_S = 6.0  # after `ready`: the normal rate is measured over its last 5 s
RAMP_S = 1.0  # the first second after `ready` is the workload's ramp, not its normal
SETTLE_S = 2.0  # after the destination resumed, as the lab's `settle`
TAIL_S = 3.0  # read the agent this long after livemig exited
LAUNCH_SLACK_S = 180.0  # livemig's own timeout: --max-time plus this
THROTTLED_PCT = 20  # timeline samples at or above this throttle are cross-checked


# -- the guest agent, read from outside ------------------------------------------------

@dataclass(frozen=True)
class Rate:
    """One agent ``rate`` line: host arrival time, bytes of pages dirtied so far
    (a :class:`livemig.metrics.WorkSample`)."""

    t: float
    work: float


class Agent(threading.Thread):
    """Everything one QEMU's guest agent says on its socket chardev, with host arrival
    times (``time.time()``, as livemig's report); reconnects after an EOF, so the
    destination's agent is heard whenever its guest starts talking."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True, name=f"agent {path.name}")
        self.path = path
        self.rates: list[Rate] = []
        self.beats: list[float] = []  # arrival of every hb and rate line
        self.ready_at: float | None = None
        self.errors: list[str] = []
        self._halt = threading.Event()

    def close(self) -> None:
        self._halt.set()
        if self.ident is not None:  # started
            self.join(timeout=2)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(self.path))
                    s.settimeout(0.1)
                    self._read(s)
            except OSError:
                pass
            self._halt.wait(0.1)

    def _read(self, s: socket.socket) -> None:
        buf = b""
        while not self._halt.is_set():
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return
            now = time.time()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self._line(now, line)

    def _line(self, now: float, line: bytes) -> None:
        try:
            d = json.loads(line)
        except ValueError:
            return
        ev = d.get("ev")
        if ev == "rate":
            self.rates.append(Rate(now, float(d["mem_bytes"])))
            self.beats.append(now)
        elif ev == "hb":
            self.beats.append(now)
        elif ev == "ready" and d.get("workload") != "idle" and self.ready_at is None:
            self.ready_at = now
        elif ev in ("error", "verify_error"):
            self.errors.append(json.dumps(d))


@dataclass(frozen=True)
class Trace:
    """What the benchmark heard from both agents, and when (host times): kept in each
    run's file (times relative to the launch, 1 ms) so that ``--summarize`` can
    analyse a run again without booting anything."""

    t_ready: float  # the source's workload said `ready`
    t_launch: float  # livemig started
    t_exit: float  # livemig exited
    src: tuple[Rate, ...]
    dst: tuple[Rate, ...]
    beats: tuple[float, ...]  # every hb and rate line of either agent

    @classmethod
    def heard(cls, src: Agent, dst: Agent, t_ready: float, t_launch: float,
              t_exit: float) -> Trace:
        return cls(t_ready, t_launch, t_exit, tuple(src.rates), tuple(dst.rates),
                   tuple(sorted(src.beats + dst.beats)))

    def as_dict(self) -> dict[str, Any]:
        t0 = self.t_launch

        def rel(rates: tuple[Rate, ...]) -> list[list[float]]:
            return [[round(r.t - t0, 3), int(r.work)] for r in rates]

        return {"t_ready": self.t_ready, "t_launch": t0, "t_exit": self.t_exit,
                "src": rel(self.src), "dst": rel(self.dst),
                "beats": [round(b - t0, 3) for b in self.beats]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        t0 = float(d["t_launch"])

        def rates(xs: list[list[float]]) -> tuple[Rate, ...]:
            return tuple(Rate(t0 + t, float(w)) for t, w in xs)

        return cls(float(d["t_ready"]), t0, float(d["t_exit"]), rates(d["src"]),
                   rates(d["dst"]), tuple(t0 + b for b in d["beats"]))


def wait_ready(agent: Agent, procs: list[subprocess.Popen[bytes]], log: Path) -> float:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while agent.ready_at is None:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"QEMU exited ({p.returncode}) before the workload "
                                   f"was ready (its log is kept beside the run)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the guest's workload not ready after {READY_TIMEOUT_S:g} s "
                               f"(console: {log.name}, kept beside the run)")
        time.sleep(0.1)
    return agent.ready_at


# -- one run ---------------------------------------------------------------------------

def _when(report: dict[str, Any]) -> dict[str, float | None]:
    """Host times of the run's phases from livemig's report: ``started_at`` plus its
    events' offsets (``phase migrating`` is taken just before ``migrate``; ``phase
    settling`` just after the destination's ``cont``)."""
    t0 = datetime.datetime.fromisoformat(report["started_at"]).timestamp()
    at: dict[str, float] = {}
    for e in report.get("events", []):
        at.setdefault(str(e.get("event")), t0 + float(e["t"]))
    t_cont = at.get("phase settling") if report.get("outcome") == "completed" else None
    hold = report.get("verify_hold_ms")
    return {"t0": t0, "t_migrate": at.get("phase migrating"), "t_cont": t_cont,
            "t_dst_done": (t_cont - hold / 1000.0) if t_cont is not None and hold else None}


def _lost(samples: list[Rate], normal: float, a: float | None, b: float | None) -> float | None:
    """Seconds of guest work lost over [a, b] (``metrics.work_lost`` on 100 ms bins)."""
    if a is None or b is None or b <= a:
        return None
    rates = [r for _, r in metrics.rate_series(samples, a, b)]
    return round(metrics.work_lost(rates, normal), 3)


def _net_lost(samples: list[Rate], normal: float, a: float, b: float) -> float | None:
    pts = metrics.rate_series(samples, a, b, b - a)  # one bin: the work done over [a, b]
    if not pts or not normal:
        return None
    return round((b - a) * (1 - pts[0][1] / normal), 3)


def throttle_check(samples: list[Rate], normal: float, timeline: list[dict[str, Any]],
                   t_migrate: float) -> list[dict[str, float]]:
    """The guest's rate while QEMU held one throttle (from the first to the last poll
    that saw it, at least 0.4 s), against what that throttle leaves (``100 -
    throttle`` %): a check of both the agent's reading and the report's timeline."""
    spans: list[list[dict[str, Any]]] = []
    for s in timeline:
        th = s.get("throttle_pct") or 0
        if s.get("status") != "active" or th < THROTTLED_PCT:
            spans.append([])
        elif spans and spans[-1] and spans[-1][0].get("throttle_pct") == th:
            spans[-1].append(s)
        else:
            spans.append([s])
    out = []
    for span in spans:
        if len(span) < 2 or span[-1]["t"] - span[0]["t"] < 0.4 or not normal:
            continue
        got = metrics.average_rate(samples, t_migrate + span[0]["t"], t_migrate + span[-1]["t"])
        if got is not None:
            out.append({"throttle_pct": span[0]["throttle_pct"],
                        "seconds": round(span[-1]["t"] - span[0]["t"], 2),
                        "guest_pct": round(100.0 * got / normal, 1)})
    return out


def analyse(report: dict[str, Any], tr: Trace, spec_rate: int) -> dict[str, Any]:
    when = _when(report)
    t_migrate, t_cont = when["t_migrate"], when["t_cont"]
    t_ready, t_launch = tr.t_ready, tr.t_launch
    end = (t_cont if t_cont is not None else tr.t_exit) + SETTLE_S
    samples = sorted(tr.src + tr.dst, key=lambda r: r.t)
    beats = list(tr.beats)
    hold = ((when["t_dst_done"], t_cont) if when["t_dst_done"] is not None
            and t_cont is not None else None)
    # what the user gets: from the command on (its sampling included) to the settle
    wl = metrics.workload_stats(samples, t_ready + RAMP_S, t_launch, end)
    normal = wl.baseline_rate or 0.0
    gap = metrics.longest_gap(beats, t_launch, end)
    # the pause around the switchover: from a little before the source stopped (QEMU's
    # downtime plus the hold before the resume) to a second after the resume
    sw = None
    if t_cont is not None:
        before = ((report.get("downtime_ms") or 0) + (report.get("verify_hold_ms") or 0)) / 1e3
        sw = metrics.longest_gap(beats, t_cont - before - 0.5, t_cont + 1.0)
    # the metric's own floor: work "lost" by an undisturbed guest, the normal rate's
    # noise below its mean (per second judged; compare work lost against window x this)
    noise = _lost(samples, normal, t_ready + RAMP_S, t_launch)
    dst_heard = [r for r in tr.dst if t_cont is not None and r.t >= t_cont]
    out: dict[str, Any] = {
        "normal_rate_mib_s": round(normal / (1 << 20), 2),
        "normal_spread_pct": wl.baseline_spread_pct,
        "spec_rate_mib_s": round(spec_rate / (1 << 20), 2) if spec_rate else None,
        "work_lost_s": wl.work_lost_s,
        "seconds_below_10pct": wl.seconds_below_10pct,
        "seconds_below_50pct": wl.seconds_below_50pct,
        "min_rate_pct": (round(100 * wl.min_rate / normal, 1)
                         if wl.min_rate is not None and normal else None),
        # the lab's window: from `migrate` to the settle
        "work_lost_migration_s": _lost(samples, normal, t_migrate, end),
        "work_lost_before_migrate_s": _lost(samples, normal, t_launch, t_migrate),
        "work_lost_in_hold_s": _lost(samples, normal, *hold) if hold else None,
        "guest_pause_ms": round(gap.seconds * 1000, 1) if gap else None,
        "guest_pause_at_s": round(gap.start - t_launch, 2) if gap else None,
        "switchover_pause_ms": round(sw.seconds * 1000, 1) if sw else None,
        "noise_lost_per_s": (round(noise / (t_launch - t_ready - RAMP_S), 4)
                             if noise is not None else None),
        "noise_s": (round(noise / (t_launch - t_ready - RAMP_S) * (end - t_launch), 3)
                    if noise is not None else None),
        # unclipped: the judged window minus the work done in it at the normal rate (a
        # paced writer's catch-up after a pause pays back here, not in work_lost_s)
        "work_lost_net_s": _net_lost(samples, normal, t_launch, end),
        "window_s": {"normal": round(t_launch - t_ready - RAMP_S, 2),
                     "before_migrate": round(t_migrate - t_launch, 2) if t_migrate else None,
                     "migrate_to_resume": (round(t_cont - t_migrate, 2)
                                           if t_cont and t_migrate else None),
                     "livemig_wall": round(tr.t_exit - t_launch, 2),
                     "judged": round(end - t_launch, 2)},
        "destination_heard_after_resume": bool(dst_heard),
    }
    if t_migrate is not None:
        out["throttle_check"] = throttle_check(samples, normal, report.get("timeline", []),
                                               t_migrate)
    return out


def essentials(report: dict[str, Any]) -> dict[str, Any]:
    enc = report.get("encoding") or {}
    sampler = enc.get("sampler") or {}
    return {
        "outcome": report.get("outcome"), "reason": report.get("reason"),
        "total_time_s": report.get("total_time_s"),
        "ram_transferred_bytes": report.get("ram_transferred_bytes"),
        "downtime_ms": report.get("downtime_ms"),
        "verify_hold_ms": report.get("verify_hold_ms"),
        "rounds": report.get("rounds"),
        "ram_check": (report.get("consistency") or {}).get("ram"),
        "cpu_seconds": report.get("cpu_seconds"),
        "encoding": report.get("encoding"),
        "encoding_short": (f"{enc.get('encoding')} ({sampler.get('name', '?')}"
                           + (f", switched from {enc['started_with']} at "
                              f"{enc.get('after_s')} s" if enc.get("switched") else
                              f", kept {enc['started_with']}" if enc.get("started_with")
                              else "") + ")"
                           if enc.get("encoding") else
                           "as set" if enc else "-"),
        "max_throttle_pct": max((s.get("throttle_pct") or 0
                                 for s in report.get("timeline", [])), default=0),
        "adapted": [e for e in report.get("events", [])
                    if e.get("event") in ("adapted", "encoding not chosen")],
    }


def livemig_env() -> dict[str, str]:
    """The subprocess runs the livemig this benchmark imported (this checkout)."""
    src = str(Path(livemig.__file__).resolve().parents[1])
    pp = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + pp if pp else "")}


def one_run(family: str, config: str, repeat: int, a: argparse.Namespace,
            runs_dir: Path) -> dict[str, Any]:
    workload, _ = FAMILIES[family]
    profile, on_stock = CONFIGS[config]
    qemu = a.stock_qemu if on_stock else a.qemu
    name = f"{family}-{config}-{repeat}"
    report_path = runs_dir / f"{name}.report.json"
    log_path = runs_dir / f"{name}.log"
    report_path.unlink(missing_ok=True)
    mem = parse_workload(workload).mem
    spec_rate = mem[0].rate if mem else 0
    d = Path(tempfile.mkdtemp(prefix="lm-hand-"))
    procs: list[subprocess.Popen[bytes]] = []
    src_agent, dst_agent = Agent(d / "src.agent"), Agent(d / "dst.agent")
    try:
        procs.append(start_qemu(d, "src", workload, memory=a.memory, qemu=qemu,
                                machine_type=a.machine, vcpus=a.vcpus))
        procs.append(start_qemu(d, "dst", workload, incoming=True, paused=True,
                                memory=a.memory,
                                qemu=a.stock_qemu if config in TO_STOCK else qemu,
                                machine_type=a.machine,
                                vcpus=a.vcpus))
        src_agent.start()
        dst_agent.start()
        t_ready = wait_ready(src_agent, procs, d / "src.console")
        time.sleep(a.warmup)
        port = free_port()
        argv = [sys.executable, "-m", "livemig.cli", "migrate",
                "--src-qmp", str(d / "src.qmp"), "--dst-qmp", str(d / "dst.qmp"),
                "--uri", f"tcp:127.0.0.1:{port}",
                *(() if a.bandwidth == "none" else ("--bandwidth", a.bandwidth)),
                "--profile", profile, "--max-time", str(a.max_time),
                "--report", str(report_path), "-q"]
        if profile == "livemig":  # an ablation: livemig with some of its settings changed
            argv += [x for kv in a.set for x in ("--set", kv)]
        argv += [x for kv in CONFIG_SETS.get(config, ()) for x in ("--set", kv)]
        t_launch = time.time()
        with open(log_path, "w") as log:
            log.write(" ".join(argv) + "\n")
            log.flush()
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                env=livemig_env(), timeout=a.max_time + LAUNCH_SLACK_S,
                                check=False).returncode
        t_exit = time.time()
        if not report_path.exists():
            raise RuntimeError(f"livemig exited {rc} without a report: {log_path}")
        report = json.loads(report_path.read_text())
        when = _when(report)
        settle_end = (when["t_cont"] or t_exit) + SETTLE_S
        time.sleep(max(0.0, max(settle_end, t_exit + TAIL_S) - time.time()))
        src_agent.close()
        dst_agent.close()
        trace = Trace.heard(src_agent, dst_agent, t_ready, t_launch, t_exit)
        return {"family": family, "config": config, "repeat": repeat, "profile": profile,
                "qemu": str(qemu), "binary": "unpatched" if on_stock else "patched",
                "destination_binary": ("unpatched" if on_stock or config in TO_STOCK
                                       else "patched"),
                "workload": workload, "memory": a.memory, "bandwidth": a.bandwidth,
                "machine": a.machine, "vcpus": a.vcpus,
                "livemig_exit": rc, "argv": argv,
                "started": datetime.datetime.fromtimestamp(t_launch, datetime.UTC).isoformat(),
                "report": report_path.name, "spec_rate": spec_rate,
                "agent_errors": src_agent.errors + dst_agent.errors,
                **essentials(report),
                "guest": analyse(report, trace, spec_rate),
                "trace": trace.as_dict()}
    except BaseException:
        for kept in ("src.console", "src.log", "dst.log"):  # what to look at, kept
            with contextlib.suppress(OSError):
                shutil.copy(d / kept, runs_dir / f"{name}.{kept}")
        raise
    finally:
        src_agent.close()
        dst_agent.close()
        for p in procs:
            stop(p)
        for f in d.iterdir():
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            d.rmdir()


# -- summary ---------------------------------------------------------------------------

# (column, getter from a run, format); lower is better for all of them
Col = tuple[str, str, str]
COLUMNS: list[Col] = [
    ("time s", "time_s", ".3g"),
    ("of it QEMU s", "total_time_s", ".3g"),
    ("RAM MiB", "ram_mib", ".0f"),
    ("downtime ms", "downtime_ms", ".3g"),
    ("guest pause ms", "guest_pause_ms", ".3g"),
    ("at switchover ms", "switchover_pause_ms", ".3g"),
    ("work lost s", "work_lost_s", ".3g"),
    ("of it noise s", "noise_s", ".2g"),
    ("net lost s", "work_lost_net_s", ".2g"),
    ("< 10 % s", "seconds_below_10pct", ".3g"),
    ("< 50 % s", "seconds_below_50pct", ".3g"),
    ("lost before migrate s", "work_lost_before_migrate_s", ".3g"),
]
# no ratio to stock (the net figure may be near 0 or below it)
NO_RATIO = frozenset({"noise_s", "work_lost_net_s", "work_lost_before_migrate_s",
                      "total_time_s"})
EXTRA = ("work_lost_migration_s", "verify_hold_ms",
         "normal_rate_mib_s")


def _get(run: dict[str, Any], key: str) -> float | None:
    if key == "ram_mib":
        b = run.get("ram_transferred_bytes")
        return None if b is None else b / (1 << 20)
    if key == "time_s":  # what the user waits: from the command's start (its sample
        # and settings included) to QEMU's completion
        before = run["guest"].get("window_s", {}).get("before_migrate")
        t = run.get("total_time_s")
        return None if t is None or before is None else float(t) + float(before)
    v = run.get(key, run["guest"].get(key))
    return None if v is None else float(v)


def _median(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return round(statistics.median(got), 3) if got else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per configuration (in CONFIGS order): medians over its completed runs."""
    out: dict[str, dict[str, Any]] = {}
    for config in CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        done = [r for r in mine if r["outcome"] == "completed"]
        row: dict[str, Any] = {"runs": len(mine), "completed": len(done),
                               "binary": mine[0]["binary"],
                               "encoding": sorted({r["encoding_short"] for r in mine}),
                               "ram_check": sorted({str(r["ram_check"]) for r in done})}
        for _, key, _ in COLUMNS:
            row[key] = _median([_get(r, key) for r in done])
        for key in EXTRA:
            row[key] = _median([_get(r, key) for r in done])
        out[config] = row
    return out


def best_stock(summary: dict[str, dict[str, Any]]) -> str | None:
    """The stock configuration to beat: most completed runs, then shortest time."""
    cands = [c for c in STOCK_CONFIGS if c in summary and summary[c]["completed"]]
    if not cands:
        return None
    return min(cands, key=lambda c: (-summary[c]["completed"],
                                     summary[c]["time_s"] or float("inf")))


def _cell(v: float | None, ref: float | None, fmt: str) -> str:
    if v is None:
        return "-"
    s = format(v, fmt)
    if ref:
        s += f" ({v / ref:.2f}×)"
    return s


def family_markdown(family: str, summary: dict[str, dict[str, Any]],
                    runs: list[dict[str, Any]]) -> str:
    workload, desc = FAMILIES[family]
    base = best_stock(summary)
    first = runs[0]
    lines = [f"### {family}: {desc}", "",
             f"`{workload}`, {first['memory']} guest ({first.get('machine', 'q35')}, "
             f"{first.get('vcpus', 1)} vCPU), "
             + ("no `--bandwidth` (QEMU's own max-bandwidth)"
                if first['bandwidth'] == "none" else f"`--bandwidth {first['bandwidth']}`")
             + ", "
             f"loopback, {max(r['repeat'] for r in runs)} interleaved repeat(s); medians of "
             "completed runs; ratios against the best stock configuration"
             + (f" (`{base}`)" if base else " (none completed)") + ".", "",
             "| configuration | QEMU | done | " + " | ".join(c for c, _, _ in COLUMNS)
             + " | hold ms | normal MiB/s | encoding |",
             "|---" * (len(COLUMNS) + 6) + "|"]
    for config, row in summary.items():
        ref = summary[base] if base and base != config else None
        cells = [_cell(row[k], ref[k] if ref and k not in NO_RATIO else None, f)
                 for _, k, f in COLUMNS]
        lines.append(f"| {config} | {row['binary']} | {row['completed']}/{row['runs']} | "
                     + " | ".join(cells)
                     + f" | {_cell(row['verify_hold_ms'], None, '.3g')}"
                     f" | {_cell(row['normal_rate_mib_s'], None, '.0f')}"
                     f" | {', '.join(row['encoding'])} |")
    lines += ["", "Each run (time s / RAM MiB / work lost s / < 10 % s / longest pause ms "
              "at s after the command / switchover pause ms / max throttle % / encoding):",
              ""]
    for r in sorted(runs, key=lambda r: (list(CONFIGS).index(r["config"]), r["repeat"])):
        g = r["guest"]
        lines.append(f"- {r['config']} #{r['repeat']}: {r['outcome']}, "
                     f"{r['total_time_s']} / {_cell(_get(r, 'ram_mib'), None, '.0f')} / "
                     f"{g['work_lost_s']} / {g['seconds_below_10pct']} / "
                     f"{g['guest_pause_ms']} at {g['guest_pause_at_s']} / "
                     f"{g.get('switchover_pause_ms')} / {r['max_throttle_pct']} / "
                     f"{r['encoding_short']}" + _warnings(r))
    return "\n".join(lines) + "\n"


def _warnings(r: dict[str, Any]) -> str:
    """What in a run makes its figures suspect."""
    g = r["guest"]
    w = []
    if r["outcome"] == "completed" and not g["destination_heard_after_resume"]:
        w.append("destination's agent never heard after the resume")
    if g["spec_rate_mib_s"] and g["normal_rate_mib_s"] < 0.9 * g["spec_rate_mib_s"]:
        w.append(f"guest ran {g['normal_rate_mib_s']} MiB/s < its spec's "
                 f"{g['spec_rate_mib_s']}")
    pause, down = g.get("switchover_pause_ms", g["guest_pause_ms"]), r["downtime_ms"]
    if pause is not None and down is not None and pause + 20 < down:
        w.append(f"longest gap {pause} ms < QEMU's downtime {down} ms")
    if r.get("agent_errors"):
        w.append(f"{len(r['agent_errors'])} agent error(s)")
    if r["outcome"] != "completed":
        w.append(f"reason: {r.get('reason')}")
    return f" — **{'; '.join(w)}**" if w else ""


def _against(summary: dict[str, dict[str, Any]], base: str, config: str, k: str,
             ratio: bool) -> str:
    row, b = summary.get(config), summary[base]
    if row is None or row[k] is None or (ratio and not b[k]):
        return "-"
    return f"{row[k] / b[k]:.2f}×" if ratio else f"{row[k]:.3g} s vs {b[k]:.3g} s"


def issue_table(sums: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Issue #20's table: per family the best stock configuration, and livemig (patched)
    and livemig@stock against it."""
    lines = ["| guest | best stock: time s / MiB / work lost s / < 10 % s | livemig: time "
             "| bytes | work lost | time below 10 % | livemig@stock: time | bytes | work "
             "lost |", "|---" * 9 + "|"]
    for family, summary in sums.items():
        base = best_stock(summary)
        if base is None:
            continue
        b = summary[base]
        cells = [_against(summary, base, c, k, ratio=r) for c, k, r in (
            ("livemig", "time_s", True), ("livemig", "ram_mib", True),
            ("livemig", "work_lost_s", False), ("livemig", "seconds_below_10pct", False),
            ("livemig@stock", "time_s", True), ("livemig@stock", "ram_mib", True),
            ("livemig@stock", "work_lost_s", True))]
        lines.append(
            f"| {family}: {FAMILIES[family][1]} | {base} "
            + " / ".join(_cell(b[k], None, f) for k, f in (
                ("time_s", ".3g"), ("ram_mib", ".0f"), ("work_lost_s", ".3g"),
                ("seconds_below_10pct", ".3g"))) + " | "
            + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, runs: list[dict[str, Any]]) -> str:
    parts = ["## Hand-started VMs through `livemig migrate --src-qmp --dst-qmp`", "",
             "Stock profiles and `livemig@stock` on the unpatched build, `livemig` on the "
             "patched one; time from the command's start (livemig's page sample and "
             "settings included) to QEMU's completion, `of it QEMU s` from `migrate` on "
             "(QEMU's total-time); work lost and time below 10 %/50 % from the command's "
             "start to "
             f"{SETTLE_S:g} s after the resume (the hold for the RAM comparison included: "
             "what a user gets; `hold ms` shows it); `of it noise s`: what the normal "
             "rate's own noise adds to work lost over the same window (see the docstring); "
             "`net lost s`: work lost without clipping each 100 ms at normal (window − work "
             "done ÷ normal rate: noisier per run, but not inflated by a longer window); "
             "guest pause = the longest gap between the guest agent's lines (a stalled QEMU "
             "main loop silences the agent too: a gap is not always a stopped guest), `at "
             "switchover` the longest around the switchover.", ""]
    sums: dict[str, Any] = {}
    for family in FAMILIES:
        mine = [r for r in runs if r["family"] == family]
        if not mine:
            continue
        sums[family] = summarize(mine)
        parts.append(family_markdown(family, sums[family], mine))
    parts.insert(4, issue_table(sums))
    md = "\n".join(parts)
    (out / "summary.md").write_text(md)
    slim = [{k: v for k, v in r.items() if k != "trace"} for r in runs]
    (out / "handstarted.json").write_text(json.dumps(
        {"summary": sums, "best_stock": {f: best_stock(s) for f, s in sums.items()},
         "runs": slim}, indent=1))
    return md


# -- main ------------------------------------------------------------------------------

def _list(text: str, known: dict[str, Any], what: str) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in known]
    if bad or not items:
        raise UsageError(f"unknown {what} {', '.join(bad) or '(none)'}: choose from "
                         f"{', '.join(known)}")
    return items


def check(a: argparse.Namespace, configs: list[str]) -> None:
    """One-line errors before anything boots."""
    need = {a.qemu: "make qemu qemu-upstream"} if any(
        not CONFIGS[c][1] for c in configs) else {}
    if any(CONFIGS[c][1] for c in configs):
        need[a.stock_qemu] = "make qemu qemu-upstream"
    need.update({KERNEL: "make guest", INITRD: "make guest"})
    for path, make in need.items():
        if not Path(path).exists():
            raise UsageError(f"{path} missing: run '{make}'")
    if a.bandwidth != "none":
        parse_size(a.bandwidth, "--bandwidth")
    parse_size(a.memory, "--memory")
    if a.vcpus < 1:
        raise UsageError("--vcpus must be at least 1")
    if os.geteuid() != 0:
        raise UsageError("run as root (livemig's attach path keeps its state in /run)")
    # the guests are ours alone: no lab, no testbed code may have been loaded
    lab = sorted(m for m in sys.modules if m.startswith(("livemig.lab", "livemig.testbed")))
    if lab:
        raise UsageError(f"lab code loaded into the benchmark: {', '.join(lab)}")


def runs_in(runs_dir: Path) -> Iterator[dict[str, Any]]:
    """The runs kept in ``runs_dir``, their guest figures computed again from the
    agent trace and livemig's report they keep (so the tables follow this file)."""
    for p in sorted(runs_dir.glob("*-[0-9]*.json")):
        if p.name.endswith(".report.json"):
            continue
        run = json.loads(p.read_text())
        rp = runs_dir / str(run.get("report", ""))
        if "trace" in run and rp.is_file():
            run["guest"] = analyse(json.loads(rp.read_text()), Trace.from_dict(run["trace"]),
                                   int(run.get("spec_rate") or 0))
        yield run


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--families", default=None,
                    help=f"comma-separated, of {', '.join(FAMILIES)} and any --family "
                    "(default: the --family ones if any, else all)")
    ap.add_argument("--family", action="append", default=[], metavar="NAME=SPEC",
                    help="one more family: a guest workload spec (as the lab's "
                    "--workload), e.g. noise=mem:size=256M,rate=40M,touch=4096,fill=random; "
                    "give it again with --summarize")
    ap.add_argument("--set", action="append", default=[], metavar="K=V",
                    help="for an ablation: passed to the livemig configurations' runs "
                    "(--set K=V); give the runs their own --out")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--bandwidth", default="50M",
                    help="livemig's --bandwidth; none: not given (QEMU's own max-bandwidth)")
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--machine", default="q35", help="QEMU's machine type (q35, pc)")
    ap.add_argument("--warmup", type=float, default=WARMUP_S,
                    help="seconds of the workload before the migration; its normal rate "
                    f"is measured over all but the first {RAMP_S:g} s")
    ap.add_argument("--max-time", type=int, default=300, help="livemig's --max-time")
    ap.add_argument("--qemu", type=Path, default=PATCHED, help="the patched build")
    ap.add_argument("--stock-qemu", type=Path, default=STOCK, help="the unpatched build")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --out/runs, run the missing ones")
    ap.add_argument("--summarize", action="store_true",
                    help="only write the tables from the runs in --out/runs")
    a = ap.parse_args()
    try:
        for item in a.family:
            name, sep, text = item.partition("=")
            if not sep or not name or "-" in name:
                raise UsageError(f"--family {item!r}: expected NAME=SPEC, NAME without '-'")
            parse_workload(text)
            FAMILIES[name] = (text, f"`{text}`")
        if a.families is None:
            a.families = ",".join(n.partition("=")[0] for n in a.family) or ",".join(FAMILIES)
        families = _list(a.families, FAMILIES, "family")
        configs = _list(a.configs, CONFIGS, "configuration")
        if a.warmup < RAMP_S + 2:
            raise UsageError(f"--warmup must be at least {RAMP_S + 2:g} s")
        if not a.summarize:
            check(a, configs)
    except UsageError as e:
        print(f"handstarted: error: {e}", file=sys.stderr)
        return 2
    runs_dir = a.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    # a kill (timeout, pkill) unwinds like Ctrl-C: each run's QEMUs are stopped by its
    # `finally`, not left running beside the next benchmark
    signal.signal(signal.SIGTERM, _terminated)
    if not a.summarize:
        for repeat in range(1, a.repeats + 1):
            for family in families:
                for config in configs:
                    path = runs_dir / f"{family}-{config}-{repeat}.json"
                    if a.resume and path.exists():
                        continue
                    print(f"== {family} {config} run {repeat}/{a.repeats}", flush=True)
                    try:
                        run = one_run(family, config, repeat, a, runs_dir)
                    except Exception as e:  # the next run may work: tell, go on
                        print(f"   error: {type(e).__name__}: {e}", file=sys.stderr,
                              flush=True)
                        continue
                    path.write_text(json.dumps(run, indent=1))
                    g = run["guest"]
                    print(f"   {run['outcome']} in {run['total_time_s']} s, "
                          f"{_cell(_get(run, 'ram_mib'), None, '.0f')} MiB, work lost "
                          f"{g['work_lost_s']} s, < 10 % {g['seconds_below_10pct']} s, "
                          f"pause {g['guest_pause_ms']} ms, {run['encoding_short']}"
                          + _warnings(run), flush=True)
    # every run in the directory of these families (a --resume may add configurations)
    runs = [r for r in runs_in(runs_dir) if r["family"] in families]
    if not runs:
        print("handstarted: no runs", file=sys.stderr)
        return 1
    print(write_summary(a.out, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
