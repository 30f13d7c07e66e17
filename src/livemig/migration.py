"""The migration orchestrator: boots both ends, migrates, verifies, reports.

State machine (every transition is logged and put in the timeline)::

    INIT ─▶ BOOTING ─▶ WARMUP ─▶ MIGRATING ─▶ SWITCHED ─▶ VERIFYING ─▶ SETTLING ─▶ DONE
              │           │          │  │                                           ▲
              │           │          │  └─(max-time, Ctrl-C)─▶ CANCELLING ─▶ SETTLING┤
              └───────────┴──────────┴───(QEMU error, dead peer)──▶ FAILED ─────────┘

Rollback rule: until the destination has resumed the guest, the source is the VM.
Whatever goes wrong before that point, the source is left (or put back) running and
the destination is killed; the report says whether the source really runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import random
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig import faults, metrics, pagesample, paths
from livemig.agent import AgentLink
from livemig.control import Controller
from livemig.diskcheck import DiskComparison, compare_images
from livemig.errors import LivemigError, UsageError, VMError
from livemig.faults import Fault
from livemig.policy import encoding, pinning
from livemig.policy.base import Snapshot
from livemig.policy.disk import choose_granularity
from livemig.progress import Progress
from livemig.ramcheck import RamComparison, compare_ram, gpa_to_offset
from livemig.settings import Resolved, resolve
from livemig.spec import Workload
from livemig.storage import DiskMirror, blockstats
from livemig.testbed import netns, topology
from livemig.testbed.probe import Prober
from livemig.vm import VM, Disk, VMConfig, is_migration_thread

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 180.0
GUEST_OVERHEAD = 160 << 20  # kernel + initramfs + agent, on top of the workload's memory
LINK_EFFICIENCY = 0.93  # TCP payload over a tbf-shaped veth (measured: 93% at 1gbit)
TERMINAL = ("completed", "failed", "cancelled")


class Phase(enum.Enum):
    INIT = "init"
    BOOTING = "booting"
    WARMUP = "warmup"
    MIGRATING = "migrating"
    CANCELLING = "cancelling"
    SWITCHED = "switched"
    VERIFYING = "verifying"
    SETTLING = "settling"
    FAILED = "failed"
    DONE = "done"


_NEXT: dict[Phase, set[Phase]] = {
    Phase.INIT: {Phase.BOOTING, Phase.FAILED},
    Phase.BOOTING: {Phase.WARMUP, Phase.FAILED, Phase.CANCELLING},
    Phase.WARMUP: {Phase.MIGRATING, Phase.FAILED, Phase.CANCELLING},
    Phase.MIGRATING: {Phase.SWITCHED, Phase.CANCELLING, Phase.FAILED},
    Phase.CANCELLING: {Phase.SETTLING, Phase.FAILED},
    Phase.SWITCHED: {Phase.VERIFYING, Phase.SETTLING, Phase.FAILED},
    Phase.VERIFYING: {Phase.SETTLING, Phase.FAILED},
    Phase.SETTLING: {Phase.DONE, Phase.FAILED},
    Phase.FAILED: {Phase.SETTLING, Phase.DONE},
    Phase.DONE: set(),
}


FAULT_KINDS = faults.KINDS


@dataclass
class MigrateOptions:
    workload: Workload
    memory: int = 1 << 30
    vcpus: int = 1
    bandwidth: int | None = None  # bytes/s cap on the migration stream
    profile: str = "livemig"
    wanted: dict[str, str] = field(default_factory=dict)  # profile + --set, merged
    explicit: frozenset[str] = frozenset()  # keys given with --set (never overridden)
    max_time: float | None = None
    qemu: Path = field(default_factory=paths.default_qemu)
    accel: str = "tcg"
    accel_reason: str = ""
    verify: bool = True
    faults: list[Fault] = field(default_factory=list)
    disk_size: int = 256 << 20
    keep_run_dir: bool = False
    run_id: str | None = None
    testbed: bool = True  # False: both QEMUs on this host, loopback (--link local)
    link: int | None = 1_000_000_000  # bits/s of the shaped migration link; None: unshaped
    storage: str = "shared"  # shared | copy
    disk_fill: str = "zero"  # zero (sparse) | mixed: the source image starts full of data
    # ping-pong (livemig verify): which testbed hosts, an already running source to
    # migrate instead of booting one, and whether to hand the destination over
    src_host: str = "src"
    dst_host: str = "dst"
    source: Running | None = None
    keep_destination: bool = False
    images: tuple[Path, Path] | None = None  # disk images owned by the caller
    testbed_held: bool = False  # the caller holds the testbed lock


@dataclass
class Running:
    """A guest that runs on, handed from one migration to the next."""

    vm: VM
    agent: AgentLink
    host: str
    image: Path | None


@dataclass
class Outcome:
    outcome: str = "failed"  # completed | aborted | failed
    reason: str | None = None


class Interrupted(LivemigError):
    """Ctrl-C or SIGTERM during a run."""


class Migration:
    """One run of ``livemig migrate``."""

    def __init__(self, opts: MigrateOptions, progress: Progress | None = None) -> None:
        self.opts = opts
        self.progress = progress or Progress(enabled=False)
        self.id = opts.run_id or uuid.uuid4().hex[:8]
        self.run_dir = paths.run_root() / self.id
        self.phase = Phase.INIT
        self.result = Outcome()
        self.timeline: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.src: VM | None = None
        self.dst: VM | None = None
        self.src_agent: AgentLink | None = None
        self.dst_agent: AgentLink | None = None
        self.resolved = Resolved()
        self.t0 = time.time()
        self.t_ready: float | None = None
        self.t_migrate: float | None = None
        self.t_end: float | None = None
        self.t_dst_done: float | None = None
        self.t_cont: float | None = None
        self.final_stats: dict[str, Any] = {}
        self.ram_check: RamComparison | None = None
        self.source_after: dict[str, Any] | None = None
        self.cpu: dict[str, float | None] = {}
        self.interrupt = asyncio.Event()
        self.controller: Controller | None = None
        self._mem_files: list[Path] = []
        self._disk_job: dict[str, Any] | None = None
        self._disk_obs: dict[str, Any] = {}  # what the disk policies see
        self._disk_prev: tuple[float, int, int] | None = None  # (t, job len, guest written)
        self.pin_plan: pinning.PinPlan | None = None
        self.pinning: dict[str, Any] = {}
        self.t_ram: float | None = None  # RAM migration started (after the disk, if copied)
        self.prober: Prober | None = None
        self.network: dict[str, Any] = {}
        self.disk: DiskMirror | None = None
        self.disk_check: DiskComparison | None = None
        self._testbed = contextlib.ExitStack()
        self._testbed_created = False
        self._images: list[Path] = []  # created by this run, removed at its end
        self._src_image: Path | None = None
        self._dst_image: Path | None = None
        self.injected: list[dict[str, Any]] = []
        self._wanted = dict(opts.wanted)
        self.encoding: dict[str, Any] | None = None

    # -- bookkeeping ------------------------------------------------------------------
    def _to(self, phase: Phase, why: str = "") -> None:
        if phase not in _NEXT[self.phase]:
            raise AssertionError(f"bad transition {self.phase.value} -> {phase.value}")
        log.info("phase %s -> %s %s", self.phase.value, phase.value, why)
        self.event(f"phase {phase.value}" + (f": {why}" if why else ""))
        self.phase = phase

    def event(self, what: str, **data: Any) -> None:
        self.events.append({"t": round(time.time() - self.t0, 3), "event": what, **data})

    # -- main -------------------------------------------------------------------------
    async def run(self) -> Outcome:
        try:
            await self._run()
        except Interrupted as e:
            await self._rollback("aborted", str(e))
        except (LivemigError, OSError) as e:
            if isinstance(e, UsageError) and self.phase in (Phase.INIT, Phase.BOOTING):
                await self._cleanup()
                raise
            await self._rollback("failed", str(e))
        finally:
            self.t_end = self.t_end or time.time()
            await self._cleanup()
        return self.result

    async def _run(self) -> None:
        o = self.opts
        paths.require_file(o.qemu, "QEMU binary", "run 'make setup' or pass --qemu")
        paths.require_file(paths.guest_kernel(), "guest kernel", "run 'make setup'")
        paths.require_file(paths.guest_initrd(), "guest initrd", "run 'make setup'")
        need = o.workload.mem_bytes + GUEST_OVERHEAD
        if need > o.memory:
            raise UsageError(
                f"workload needs about {need >> 20} MiB of guest RAM but --memory is "
                f"{o.memory >> 20} MiB"
            )
        if o.storage == "copy" and not o.testbed:
            raise UsageError("--storage copy needs the testbed's hosts (not --link local)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._to(Phase.BOOTING)
        self.progress.step(f"run {self.id}: accel {o.accel} ({o.accel_reason}), "
                           f"QEMU {o.qemu}, logs in {self.run_dir}")
        if o.testbed:
            self._testbed_up()
        src_disks, dst_disks = self._make_disks()
        if o.source is not None:
            self.src, self.src_agent = o.source.vm, o.source.agent
            self._mem_files.append(self.src.config.mem_path)
            self.t_ready = time.time()
        else:
            self.src, self.src_agent = await self._launch("src", src_disks, incoming=False)
            await self._check_interrupt()
            self.progress.step(f"source booting, workload {o.workload.text}")
            await self._wait_ready()
        if o.testbed:
            await self._start_probes()
        await self._choose_encoding()
        self.resolved = await self._resolve_settings()
        self.dst, self.dst_agent = await self._launch("dst", dst_disks, incoming=True)
        await self._apply_settings()
        await self._make_controller()
        host = topology.MIG_ADDR[o.dst_host] if o.testbed else "127.0.0.1"
        uri = f"tcp:{host}:{_free_port()}"
        await self.dst.cmd("migrate-incoming", uri=uri)

        self._to(Phase.WARMUP)
        warm = float(self.resolved.livemig["warmup"])
        self.progress.step(f"measuring the workload's normal rate for {warm:.0f}s")
        await self._sleep(warm)

        self._to(Phase.MIGRATING)
        self.src.sample_threads()
        self.cpu["source_before"] = self.src.cpu_seconds()
        self.t_migrate = time.time()
        if o.storage == "copy":
            await self._start_disk_copy()
            if self.resolved.livemig["disk-schedule"] in ("first", "libvirt"):
                await self._wait_disk_ready()
        self._plan_pinning()
        self.t_ram = time.time()
        await self.src.cmd("migrate", uri=uri)
        self.progress.step("migration started" if self.disk is None else
                           "disk in sync; RAM migration started" if self.disk.stats.ready_at
                           else "RAM migration started while the disk copies")
        status = await self._monitor()
        await self._release_controls()
        if status == "completed":
            await self._switchover()
        elif status == "cancelled":
            await self._finish_cancel()
        else:
            raise VMError(f"migration {status}: {self.final_stats.get('error-desc', '?')}")

    # -- steps ------------------------------------------------------------------------
    async def _launch(self, name: str, disks: list[Disk],
                      incoming: bool) -> tuple[VM, AgentLink]:
        """Start one end's QEMU and connect to its monitor and its guest agent. The
        attributes are set as soon as each exists, so cleanup finds them on failure."""
        vm = VM(self._vm_config(name, disks, incoming))
        setattr(self, name, vm)
        vm.start()
        await vm.connect()
        agent = AgentLink(name, vm.config.agent_path)
        setattr(self, f"{name}_agent", agent)
        await agent.connect()
        return vm, agent

    def _make_disks(self) -> tuple[list[Disk], list[Disk]]:
        """Shared storage: one image both hosts open. Copy: one image per host, the
        destination's empty until the mirror fills it."""
        w = self.opts.workload
        if not (w.disk or (w.verify and w.verify.disk)):
            return [], []
        if self.opts.images is not None:
            a, b = self.opts.images
            here = self.opts.source.image if self.opts.source and self.opts.source.image else a
            there = here if self.opts.storage == "shared" else (b if here == a else a)
            self._src_image, self._dst_image = here, there
            return [Disk(here)], [Disk(there)]
        need = max([d.size or 0 for d in w.disk] + [w.verify.disk if w.verify else 0])
        size = max(self.opts.disk_size, need)
        names = ["disk0.raw"] if self.opts.storage == "shared" else [
            "src-disk0.raw", "dst-disk0.raw"]
        for i, name in enumerate(names):
            img = self.run_dir / name
            with open(img, "wb") as f:
                f.truncate(size)
            if i == 0 and self.opts.disk_fill == "mixed":
                fill_image(img, size)
            self._images.append(img)
            self.event("disk created", path=str(img), size=size)
        self._src_image, self._dst_image = self._images[0], self._images[-1]
        return [Disk(self._src_image)], [Disk(self._dst_image)]

    def _testbed_up(self) -> None:
        """Take the testbed for this run; create it (and later remove it) if needed."""
        o = self.opts
        if o.testbed_held:
            topology.set_link(o.link)
            return
        self._testbed.enter_context(topology.locked())
        if topology.is_up():
            topology.set_link(o.link)
        else:
            self.progress.step("creating the testbed hosts (network namespaces)")
            topology.up(o.link, owner=f"run {self.id}")
            self._testbed_created = True
        rate = "unshaped" if o.link is None else f"{o.link / 1e6:g} Mbit/s"
        self.event("testbed", link_bits=o.link, created=self._testbed_created)
        self.progress.step(f"hosts {topology.HOSTS['src']} -> {topology.HOSTS['dst']}, "
                           f"migration link {rate}, storage {o.storage}")

    async def _start_probes(self) -> None:
        """The client starts probing the guest; it must answer before we migrate."""
        self.prober = Prober()
        self.prober.start()
        deadline = time.monotonic() + 15
        while not self.prober.stats.replies:
            await self._check_interrupt()
            if time.monotonic() > deadline:
                raise VMError(f"the guest does not answer the client's probes at "
                              f"{topology.GUEST_IP} (console: {self.src.config.console_path})"
                              if self.src else "no guest")
            await asyncio.sleep(0.05)
        self.progress.step(f"client probes the guest at {topology.GUEST_IP} every "
                           f"{self.prober.interval * 1000:.0f} ms")

    async def _start_disk_copy(self) -> None:
        """Mirror the disk into the destination's NBD export."""
        assert self.src is not None and self.dst is not None
        lm = self.resolved.livemig
        gran = lm["disk-granularity"]
        why = "set explicitly"
        if gran == "auto":
            st = await blockstats(self.src.cmd)
            gran = choose_granularity(st.get("wr_bytes", 0), st.get("wr_operations", 0))
            avg = st.get("wr_bytes", 0) / max(st.get("wr_operations", 0), 1)
            why = (f"auto: guest writes average {avg / 1024:.1f} KiB over "
                   f"{st.get('wr_operations', 0)} writes")
        self.disk = DiskMirror(self.src.cmd, self.dst.cmd, topology.MIG_ADDR[self.opts.dst_host],
                               "disk0", int(gran), int(lm["disk-speed"]),
                               str(lm["disk-copy-mode"]))
        await self.disk.start()
        self.event("disk mirror started", granularity=self.disk.granularity,
                   granularity_reason=why, speed=self.disk.speed,
                   copy_mode=self.disk.copy_mode, schedule=lm["disk-schedule"])
        self.progress.step(f"copying the disk (granularity {self.disk.granularity >> 10}K, "
                           f"{why}; mode {self.disk.copy_mode}, schedule "
                           f"{lm['disk-schedule']})")

    async def _wait_disk_ready(self, frozen: bool = False) -> None:
        """Disk first: RAM waits until the mirror's first full pass is done. The disk
        policies (IO QoS) already act here, unless the guest is ``frozen``."""
        assert self.src is not None and self.dst is not None and self.disk is not None
        last_report = 0.0
        while True:
            job = await self.disk.poll()
            assert job is not None
            now = time.time()
            self._disk_job = job
            await self._observe_disk(now)
            if not frozen and self.controller is not None and self.controller.active:
                assert self.t_migrate is not None
                await self.controller.tick(Snapshot.from_query_migrate(
                    now - self.t_migrate, {}, self._disk_obs), self.src.cmd)
            if job.get("ready"):
                self.event("disk mirror ready", offset=job["offset"], len=job["len"])
                return
            if now - last_report >= 1.0:
                last_report = now
                self.progress.step(f"disk: {job['offset'] >> 20} of {job['len'] >> 20} MiB "
                                   "copied")
            await self._check_interrupt()
            if self.opts.max_time and now - (self.t_migrate or now) > self.opts.max_time:
                raise Interrupted(f"disk copy not done within --max-time {self.opts.max_time:g}s")
            if not self.dst.alive():
                raise VMError(f"destination QEMU died: {self.dst.log_tail()}")
            await asyncio.sleep(0.1)

    async def _choose_encoding(self) -> None:
        """``encoding=auto``: look at the pages the guest rewrites and pick the stream
        encoding that suits them (settings given with --set win)."""
        want = self._wanted.get("encoding", "off")
        if want == "off" or self.src is None:
            return
        given = sorted(self.opts.explicit & encoding.KEYS)
        if given:
            self.event("encoding not chosen", reason=f"set explicitly: {', '.join(given)}")
            return
        if want == "auto":
            pairs = await pagesample.rewritten_pages(self.src.config.mem_path)
            choice = encoding.choose(pairs)
        elif want in encoding.ENCODINGS:
            choice = encoding.Choice(want, "set explicitly")
        else:
            raise UsageError(f"bad --set encoding={want}: auto, off or one of "
                             f"{', '.join(encoding.ENCODINGS)}")
        applied = {k: v for k, v in encoding.ENCODINGS[choice.encoding].items()
                   if k not in self.opts.explicit}
        self._wanted.update(applied)
        self.encoding = {"encoding": choice.encoding, "reason": choice.reason,
                         "changed_share": choice.changed_share, "zlib_ratio": choice.ratio,
                         "samples": choice.samples, "applied": applied}
        self.event("encoding chosen", **self.encoding)
        self.progress.step(f"stream encoding {choice.encoding}: {choice.reason}")

    async def _release_controls(self) -> None:
        """No throttle and no IO cap survive the migration, whatever its outcome."""
        if self.controller is not None and self.src is not None and self.src.alive():
            await self.controller.release(self.src.cmd)

    async def _observe_disk(self, now: float) -> None:
        """The mirror's backlog, how fast it is re-dirtied, how fast the guest writes."""
        assert self.disk is not None and self._disk_job is not None
        job = self._disk_job
        written = await self.disk.guest_written()
        obs: dict[str, Any] = {"remaining": int(job["len"]) - int(job["offset"]),
                               "total": int(job["len"]), "ready": bool(job.get("ready"))}
        if self._disk_prev is not None and now > self._disk_prev[0]:
            dt = now - self._disk_prev[0]
            obs["dirty_rate"] = max(0, int(job["len"]) - self._disk_prev[1]) / dt
            obs["write_rate"] = max(0, written - self._disk_prev[2]) / dt
        self._disk_prev = (now, int(job["len"]), written)
        self._disk_obs = obs

    def _plan_pinning(self) -> None:
        assert self.src is not None
        mode = str(self.resolved.livemig["pin"])
        cpus = sorted(os.sched_getaffinity(0))
        self.pin_plan, why = pinning.plan(cpus, self.opts.vcpus, mode)
        self.pinning = {"mode": mode, "applied": self.pin_plan is not None, "reason": why,
                        "threads": {}}
        if mode != "off":
            self.event("pinning", **{k: v for k, v in self.pinning.items() if k != "threads"})
        if self.pin_plan is not None:
            self._pin_threads()

    def _pin_threads(self) -> None:
        """Pin the source's vCPU and migration threads (new ones appear as it runs)."""
        assert self.src is not None and self.pin_plan is not None
        done: dict[str, list[int]] = self.pinning["threads"]
        for tid, comm in self.src.threads().items():
            key = f"{tid}:{comm}"
            if key in done:
                continue
            if pinning.is_vcpu_thread(comm):
                cpus = self.pin_plan.vcpu_cpus
            elif is_migration_thread(comm):
                cpus = self.pin_plan.migration_cpus
            else:
                continue
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError as e:
                log.info("cannot pin %s: %s", key, e)
                continue
            done[key] = sorted(cpus)

    async def _disk_switchover(self) -> None:
        """QEMU paused at pre-switchover: finish the mirror, then let RAM complete."""
        assert self.src is not None and self.src.qmp is not None and self.disk is not None
        self.progress.step("guest frozen: finishing the disk mirror before the switchover")
        if self.disk.stats.ready_at is None:  # concurrent: RAM was done first
            await self._wait_disk_ready(frozen=True)
        await self.disk.finish(self.src.qmp)
        self.event("disk mirror finished", **self.disk.stats.as_report())
        await self.src.cmd("migrate-continue", state="pre-switchover")

    def _vm_config(self, name: str, disks: list[Disk], incoming: bool) -> VMConfig:
        """``name`` is the role (src/dst); the testbed host comes from the options."""
        o = self.opts
        mem_path = paths.shm_root() / f"livemig-{self.id}-{name}.ram"
        with contextlib.suppress(FileNotFoundError):
            mem_path.unlink()
        self._mem_files.append(mem_path)
        append = f"console=ttyS0 quiet livemig.workload={o.workload.text}"
        prefix: list[str] = []
        extra: list[str] = []
        if o.testbed:
            host = o.src_host if name == "src" else o.dst_host
            prefix = netns.exec_prefix(topology.HOSTS[host])
            extra = ["-netdev", f"tap,id=net0,ifname={topology.TAP},script=no,downscript=no",
                     "-device", f"virtio-net-pci,netdev=net0,mac={topology.GUEST_MAC},romfile="]
            append += f" livemig.ip={topology.GUEST_IP}/{topology.GUEST_PREFIX}"
        return VMConfig(
            name=name, run_id=self.id, qemu=o.qemu, memory=o.memory, vcpus=o.vcpus, accel=o.accel,
            kernel=paths.guest_kernel(), initrd=paths.guest_initrd(), append=append,
            run_dir=self.run_dir, mem_path=mem_path, incoming=incoming,
            start_paused=incoming and o.verify, disks=disks,
            exec_prefix=prefix, extra_args=extra,
        )

    async def _wait_ready(self) -> None:
        assert self.src is not None and self.src_agent is not None
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not self.src_agent.ready.is_set():
            await self._check_interrupt()
            if not self.src.alive():
                raise VMError(f"source QEMU exited during boot: {self.src.log_tail()}")
            if self.src_agent.errors:
                raise UsageError(f"guest agent: {self.src_agent.errors[-1]}")
            if time.monotonic() > deadline:
                raise VMError(f"guest not ready within {BOOT_TIMEOUT_S:.0f}s "
                              f"(console: {self.src.config.console_path})")
            await asyncio.sleep(0.05)
        self.t_ready = time.time()
        self.event("guest ready", boot_s=round(self.t_ready - (self.src.started_at or 0), 2))
        self.progress.step(f"guest ready after {self.t_ready - (self.src.started_at or 0):.1f}s")

    async def _resolve_settings(self) -> Resolved:
        assert self.src is not None
        caps = {c["capability"]: c["state"] for c in await self.src.cmd(
            "query-migrate-capabilities")}
        params = await self.src.cmd("query-migrate-parameters")
        wanted = dict(self._wanted)
        if self.opts.bandwidth is not None:
            wanted["max-bandwidth"] = str(self.opts.bandwidth)
        return resolve(wanted, caps, params)

    async def _apply_settings(self) -> None:
        r = self.resolved
        # 'events' makes QEMU emit MIGRATION events: their timestamps time the switchover
        caps = {"events": True, **r.capabilities}
        if self.opts.storage == "copy":
            # stop at pre-switchover, so the disk mirror finishes with the guest frozen
            caps["pause-before-switchover"] = True
        if self.opts.source is not None:
            await self._reset_source_settings()
        for vm in (self.src, self.dst):
            assert vm is not None
            await vm.cmd("migrate-set-capabilities", capabilities=[
                {"capability": k, "state": v} for k, v in caps.items()])
            if r.parameters:
                await vm.cmd("migrate-set-parameters", **r.parameters)
        self.event("settings applied", **r.as_dict())

    async def _reset_source_settings(self) -> None:
        """A source that was the destination of an earlier migration still has that
        migration's settings: give it a fresh QEMU's (the new destination's) first."""
        assert self.src is not None and self.dst is not None
        fresh = {c["capability"]: c["state"] for c in await self.dst.cmd(
            "query-migrate-capabilities")}
        now = {c["capability"]: c["state"] for c in await self.src.cmd(
            "query-migrate-capabilities")}
        off = [{"capability": k, "state": v} for k, v in fresh.items() if now.get(k) != v]
        if off:
            await self.src.cmd("migrate-set-capabilities", capabilities=off)
        fresh_p = await self.dst.cmd("query-migrate-parameters")
        now_p = await self.src.cmd("query-migrate-parameters")
        diff = {k: v for k, v in fresh_p.items() if now_p.get(k) != v}
        if diff:
            await self.src.cmd("migrate-set-parameters", **diff)

    async def _make_controller(self) -> None:
        assert self.src is not None
        params = await self.src.cmd("query-migrate-parameters")
        commands = {c["name"] for c in await self.src.cmd("query-commands")}
        o = self.opts
        link = None
        if o.storage == "copy" and o.testbed and o.link is not None:
            link = o.link / 8 * LINK_EFFICIENCY
        self.controller = Controller(
            self.resolved.livemig, params, o.accel,
            int(params.get("downtime-limit", 300)),
            lambda what, data: self.event(what, **data),
            disk_link=link, ram_cap=o.bandwidth, qemu_commands=commands)

    async def _control(self, now: float, info: dict[str, Any]) -> str | None:
        """Let the policies act; return a reason to cancel if one decided to abort."""
        c = self.controller
        if c is None or not c.active or info.get("status") != "active":
            return None
        assert self.src is not None and self.t_migrate is not None
        forced = c.forced
        snap = Snapshot.from_query_migrate(now - self.t_migrate, info, self._disk_obs or None)
        await c.tick(snap, self.src.cmd)
        if c.forced and not forced:
            self.progress.step(c.forced)
        if c.postcopy:
            self.progress.step(c.postcopy)
        return c.abort_reason

    async def _monitor(self) -> str:
        """Poll the source until the migration ends; cancel on max-time or Ctrl-C."""
        assert self.src is not None and self.dst is not None and self.t_migrate
        interval = float(self.resolved.livemig["poll-interval"])
        cancelled_for: str | None = None
        while True:
            info = await self.src.cmd("query-migrate")
            self.src.sample_threads()
            now = time.time()
            self._record_sample(now, info)
            status = info.get("status", "?")
            if status in TERMINAL:
                self.final_stats = info
                if cancelled_for and status == "cancelled":
                    self.result.reason = cancelled_for
                return str(status)
            if status == "pre-switchover" and self.disk is not None and self.disk.active \
                    and not cancelled_for:
                await self._disk_switchover()
                continue
            if self.disk is not None and self.disk.active:
                self._disk_job = await self.disk.poll()
                await self._observe_disk(now)
            if self.pin_plan is not None:
                self._pin_threads()
            policy_abort = await self._control(now, info)
            if cancelled_for is None:
                if policy_abort:
                    cancelled_for = policy_abort
                elif self.interrupt.is_set():
                    cancelled_for = "interrupted"
                elif self.opts.max_time and now - self.t_migrate > self.opts.max_time:
                    cancelled_for = f"did not converge within --max-time {self.opts.max_time:g}s"
                elif not self.dst.alive():
                    raise VMError(f"destination QEMU died: {self.dst.log_tail()}")
                if cancelled_for:
                    self._to(Phase.CANCELLING, cancelled_for)
                    self.progress.step(f"cancelling: {cancelled_for}")
                    await self.src.cmd("migrate_cancel")
            await asyncio.sleep(interval)

    def _record_sample(self, now: float, info: dict[str, Any]) -> None:
        assert self.t_migrate is not None
        ram = info.get("ram", {})
        page = ram.get("page-size", 4096) or 4096
        mbps = ram.get("mbps")
        remaining = ram.get("remaining")
        bandwidth = mbps * 1e6 / 8 if mbps else None
        sample: dict[str, Any] = {
            "t": round(now - self.t_migrate, 3),
            "status": info.get("status"),
            "rounds": ram.get("dirty-sync-count", 0),
            "transferred": ram.get("transferred"),
            "remaining": remaining,
            "dirty_rate": (ram.get("dirty-pages-rate") or 0) * page,
            "bandwidth": bandwidth,
            "throttle_pct": info.get("cpu-throttle-percentage", 0),
            "expected_downtime_ms": info.get("expected-downtime"),
            "guest_rate": self._guest_rate(),
        }
        job = self._disk_job if self.disk is not None and self.disk.active else None
        if job is not None:
            sample["remaining_disk"] = int(job["len"]) - int(job["offset"])
        if ram.get("deferred-pages") is not None:
            sample["deferred_pages"] = ram.get("deferred-pages")
        if sample["guest_rate"] is not None and self._baseline():
            sample["guest_rate_pct"] = 100.0 * sample["guest_rate"] / self._baseline()
        if bandwidth and remaining is not None:
            sample["eta_s"] = remaining / bandwidth
        self.timeline.append(sample)
        self.progress.sample(now - self.t_migrate, sample)

    def _all_rates(self) -> list[Any]:
        rates: list[Any] = []
        for a in (self.src_agent, self.dst_agent):
            if a is not None:
                rates += a.rates
        return rates

    def _guest_rate(self) -> float | None:
        now = time.time()
        return metrics.average_rate(self._all_rates(), now - 1.0, now)

    def _baseline(self) -> float | None:
        if self.t_ready is None or self.t_migrate is None:
            return None
        return metrics.average_rate(self._all_rates(), self.t_ready, self.t_migrate)

    async def _switchover(self) -> None:
        assert self.src is not None and self.dst is not None
        self._to(Phase.SWITCHED)
        self.cpu["source"] = _delta(self.src.cpu_seconds(), self.cpu.get("source_before"))
        self.t_dst_done = await self._wait_destination_done()
        if self.disk is not None:
            await self.disk.stop_export()
        if self.opts.verify:
            self._to(Phase.VERIFYING)
            for fault in self.opts.faults:
                self._inject(fault)
            self.progress.step("comparing guest RAM: source vs destination")
            src_file, dst_file = self.src.config.mem_path, self.dst.config.mem_path
            self.ram_check = await asyncio.to_thread(
                compare_ram, src_file, dst_file, self.opts.memory)
            self.event("ram compared", **self.ram_check.as_dict())
            if self.disk is not None:
                self.progress.step("comparing the disk images: source vs destination")
                assert self._src_image is not None and self._dst_image is not None
                self.disk_check = await asyncio.to_thread(
                    compare_images, self._src_image, self._dst_image)
                self.event("disk compared", **self.disk_check.as_dict())
            await self.dst.cmd("cont")
            self.t_cont = time.time()
            if self.opts.testbed:
                # QEMU announced the guest's MAC when the migration completed, while we
                # held the guest; say it again now that it runs, so switches learn it
                with contextlib.suppress(VMError):
                    await self.dst.cmd("announce-self", initial=50, max=550, rounds=5,
                                       step=100)
        self.result = Outcome("completed")
        self._to(Phase.SETTLING)
        taps_before = self._tap_counters()
        t_settle = time.time()
        await self._sleep(float(self.resolved.livemig["settle"]), interruptible=False)
        self._who_answers(taps_before, t_settle)
        self.cpu["destination"] = self.dst.cpu_seconds()
        status = await self.dst.cmd("query-status")
        self.event("destination after", status=status.get("status"))
        if status.get("status") != "running":
            raise VMError(f"destination is {status.get('status')} after the migration")

    async def _wait_destination_done(self) -> float:
        """Wait for the destination to finish loading; return when it did.

        The time comes from the timestamp QEMU puts on its MIGRATION event, so the
        polling latency of livemig does not count as guest pause."""
        assert self.dst is not None and self.dst.qmp is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                ev = await asyncio.wait_for(self.dst.qmp.events.get(), 0.05)
                if ev.get("event") == "MIGRATION":
                    status = ev.get("data", {}).get("status")
                    if status == "completed":
                        ts = ev.get("timestamp", {})
                        return float(ts.get("seconds", 0)) + ts.get("microseconds", 0) / 1e6
                    if status == "failed":
                        info = await self.dst.cmd("query-migrate")
                        raise VMError("destination failed to load: "
                                      f"{info.get('error-desc', '?')}")
            if not self.dst.alive():
                raise VMError(f"destination QEMU died: {self.dst.log_tail()}")
        raise VMError("destination did not finish loading within 60s")

    def _tap_counters(self) -> dict[str, dict[str, int]] | None:
        if not self.opts.testbed:
            return None
        o = self.opts
        return {"src": topology.tap_counters(o.src_host), "dst": topology.tap_counters(o.dst_host)}

    def _who_answers(self, before: dict[str, dict[str, int]] | None, since: float) -> None:
        """After the switchover, which host's tap carried the guest's replies?"""
        after = self._tap_counters()
        if before is None or after is None or self.prober is None:
            return
        replies = self.prober.stats.replies_between(since, time.time())
        src_tx = after["src"]["rx_packets"] - before["src"]["rx_packets"]
        dst_tx = after["dst"]["rx_packets"] - before["dst"]["rx_packets"]
        answered = "nobody"
        if replies and dst_tx >= replies and src_tx == 0:
            answered = "destination"
        elif replies and src_tx > 0:
            answered = "source"
        self.network["after_switchover"] = {
            "answered_by": answered, "replies": replies,
            "packets_from_guest_on_dst_tap": dst_tx, "packets_from_guest_on_src_tap": src_tx,
        }
        self.event("network after switchover", **self.network["after_switchover"])

    def _inject(self, fault: Fault) -> None:
        """Corrupt the destination (frozen, not yet resumed); remember exactly where."""
        assert self.dst is not None
        ram_file = self.dst.config.mem_path
        if fault.target == "disk":
            if self.disk is None or self._dst_image is None:
                raise UsageError(f"{fault.kind} faults need --storage copy and a disk")
            w = self.opts.workload
            offset = fault.address
            if fault.kind == "disk-stamped":
                limit = w.verify.disk if w.verify and w.verify.disk else 0
                offset = faults.pick_stamped(self._dst_image, fault.address, limit)
            faults.flip_byte(self._dst_image, offset)
            where, what = offset, "the destination's disk image at offset"
        else:
            offset = gpa_to_offset(fault.address, self.opts.memory)
            if fault.kind == "ram-stamped":
                offset = faults.pick_stamped(ram_file, fault.address)
            faults.flip_byte(ram_file, offset)
            where, what = faults.ram_gpa(offset, self.opts.memory), "destination RAM at"
        record = {"kind": fault.kind, "target": fault.target, "address": f"{where:#x}",
                  "block": f"{where & ~(faults.BLOCK - 1):#x}", "t": time.time()}
        self.injected.append(record)
        self.event("fault injected", **record)
        self.progress.step(f"FAULT INJECTED: flipped a byte of {what} {where:#x}")

    async def _finish_cancel(self) -> None:
        self.result = Outcome("aborted", self.result.reason or "cancelled")
        await self._source_after()

    async def _rollback(self, outcome: str, reason: str) -> None:
        """Leave the source running, kill the destination, say what happened."""
        log.info("rollback: %s: %s", outcome, reason)
        self.progress.step(f"{outcome}: {reason}")
        self.t_end = time.time()
        if self.result.outcome == "completed":
            # switched over already: the destination is the VM now; only record.
            self.result = Outcome("failed", reason)
            with contextlib.suppress(AssertionError):
                self._to(Phase.FAILED, reason)
            return
        self.result = Outcome(outcome, reason)
        with contextlib.suppress(AssertionError):
            self._to(Phase.FAILED, reason)
        if self.src is None or not self.src.alive() or self.t_migrate is None:
            return
        with contextlib.suppress(LivemigError):
            await self._release_controls()
            info = await self.src.cmd("query-migrate")
            if self.disk is not None:
                await self.disk.abandon()
            if info.get("status") not in (*TERMINAL, None):
                await self.src.cmd("migrate_cancel")
                await self._wait_source_terminal()
        await self._source_after()

    async def _wait_source_terminal(self) -> None:
        assert self.src is not None
        for _ in range(200):
            info = await self.src.cmd("query-migrate")
            if info.get("status") in TERMINAL:
                self.final_stats = info
                return
            await asyncio.sleep(0.05)

    async def _source_after(self) -> None:
        """After a cancel or failure: make sure the source runs and its guest works."""
        assert self.src is not None
        if self.dst is not None:
            self.dst.kill()
        self.cpu["source"] = _delta(self.src.cpu_seconds(), self.cpu.get("source_before"))
        after: dict[str, Any] = {"running": False}
        try:
            status = (await self.src.cmd("query-status")).get("status")
            if status in ("postmigrate", "paused", "finish-migrate"):
                self.event("source was left paused; resuming it", status=status)
                await self.src.cmd("cont")
                status = (await self.src.cmd("query-status")).get("status")
            after["status"] = status
            after["running"] = status == "running"
            t = time.time()
            await self._sleep(float(self.resolved.livemig["settle"]), interruptible=False)
            src_rates = self.src_agent.rates if self.src_agent else []
            after["workload_rate"] = metrics.average_rate(src_rates, t, time.time())
        except LivemigError as e:
            after["error"] = str(e)
        after["destination_alive"] = bool(self.dst and self.dst.alive())
        self.source_after = after
        self.event("source after", **after)

    async def _sleep(self, seconds: float, interruptible: bool = True) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if interruptible:
                await self._check_interrupt()
            await asyncio.sleep(min(0.05, end - time.monotonic()) if end > time.monotonic()
                                else 0)

    async def _check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise Interrupted("interrupted")

    async def _cleanup(self) -> None:
        self.progress.close()
        if self.prober is not None:
            self.prober.stop()
            self.network.update(self.prober.summary(
                self.t_migrate or self.prober.started or time.time(),
                self.t_end or time.time(), self._hold()))
        keep = self.handed_over()
        if keep is not None:
            self._mem_files.remove(keep.vm.config.mem_path)
        for agent in (self.src_agent, self.dst_agent):
            if agent is not None and (keep is None or agent is not keep.agent):
                await agent.close()
        for vm in (self.dst, self.src):
            if vm is not None and (keep is None or vm is not keep.vm):
                with contextlib.suppress(Exception):
                    await vm.stop()
        for f in self._mem_files:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        for img in self._images:
            with contextlib.suppress(FileNotFoundError):
                img.unlink()
        if self._testbed_created:
            topology.down(quiet=True)
        self._testbed.close()
        if self.result.outcome == "completed" and not self.opts.keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def handed_over(self) -> Running | None:
        """With ``keep_destination``: the guest now running on the destination."""
        if not self.opts.keep_destination or self.result.outcome != "completed":
            return None
        if self.dst is None or self.dst_agent is None or not self.dst.alive():
            return None
        return Running(self.dst, self.dst_agent, self.opts.dst_host, self._dst_image)

    def _hold(self) -> tuple[float, float] | None:
        if self.t_cont is not None and self.t_dst_done is not None:
            return (self.t_dst_done, self.t_cont)
        return None

    # -- results ----------------------------------------------------------------------
    def pause(self) -> dict[str, float | None]:
        """Longest guest-visible silence, minus the time the guest was held for the
        RAM comparison (which a real migration does not have)."""
        beats: list[float] = []
        for a in (self.src_agent, self.dst_agent):
            if a is not None:
                beats += a.heartbeats
        if self.t_migrate is None:
            return {"guest_pause_ms": None, "guest_pause_raw_ms": None, "verify_hold_ms": None}
        end = (self.t_cont or self.t_end or time.time()) + 1.0
        gap = metrics.longest_gap(beats, self.t_migrate, end)
        hold = None
        if self.t_cont is not None and self.t_dst_done is not None:
            hold = self.t_cont - self.t_dst_done
        raw = gap.seconds if gap else None
        pause = raw
        if gap and hold is not None and gap.start <= self.t_dst_done <= gap.end:  # type: ignore[operator]
            pause = max(gap.seconds - hold, 0.0)
        return {
            "guest_pause_ms": _ms(pause),
            "guest_pause_raw_ms": _ms(raw),
            "verify_hold_ms": _ms(hold),
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000.0, 1)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def fill_image(path: Path, size: int) -> None:
    """Fill a disk image like a used disk: per 4 KiB block a mix of random, text-like
    and zero blocks (the mirror copies every byte; compressibility does not matter)."""
    rng = random.Random(0x11FE)
    words = b"lorem ipsum dolor sit amet select from where index page row table "
    blocks = []
    for i in range(256):
        kind = i % 4
        if kind == 0:
            blocks.append(rng.randbytes(4096))
        elif kind == 3:
            blocks.append(bytes(4096))
        else:
            blocks.append((words * 64)[rng.randrange(64):][:4096].ljust(4096, b" "))
    chunk = b"".join(blocks)  # 1 MiB
    with open(path, "r+b") as f:
        for off in range(0, size, len(chunk)):
            f.write(off.to_bytes(8, "little") + chunk[8:min(len(chunk), size - off)])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_root() -> None:
    if os.geteuid() != 0:
        raise UsageError("livemig must run as root (namespaces, /run/livemig, /dev/shm)")
