"""A lab run: boot a guest with a workload on the testbed, hand both ends to the
engine, and measure what only the lab can (guest agent, client probes, disks).

    boot source ─▶ wait for the guest ─▶ probes ─▶ stream encoding ─▶ boot destination
      ─▶ Engine.run (negotiate, warm-up, disk copy, migrate, monitor, verify, resume)
      ─▶ after an abort: the source's workload still progresses ─▶ clean up

The lab is one caller of :class:`livemig.engine.run.Engine`; it plugs in through
the engine's :class:`Hooks`: the warm-up, the disk mirror (copied storage), thread
pinning, guest metrics in the timeline, fault injection before the comparison, the
disk comparison, the guest's address announcement after the switchover.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from livemig import idlecpu, metrics, paths, private
from livemig.attach import run_attach
from livemig.engine.actuator import DiskTargets
from livemig.engine.adapt import Adapted, Hints, adapt
from livemig.engine.events import EventStream, progress_listener
from livemig.engine.observe import Observation
from livemig.engine.plan import Plan
from livemig.engine.record import MigrationRecord
from livemig.engine.run import Engine, Hooks, Interrupted
from livemig.errors import LivemigError, UsageError, VMError
from livemig.lab import faults, pagesample, qemutrace
from livemig.lab.agent import AgentLink
from livemig.lab.disk import DiskCopy, disks, make_images
from livemig.lab.diskcheck import DiskComparison, compare_images
from livemig.lab.faults import Fault
from livemig.lab.leftovers import RunState, reap
from livemig.lab.net import NetSpec
from livemig.lab.service import ServiceRun
from livemig.lab.storage import GUEST_DISK, DiskMirror
from livemig.lab.storage import JOB as MIRROR_JOB
from livemig.lab.vm import VM, Disk, VMConfig
from livemig.progress import Progress
from livemig.ramcheck import gpa_to_offset
from livemig.report import LabFacts, build_report
from livemig.spec import Workload
from livemig.testbed import netns, topology, vswitch
from livemig.testbed.probe import Prober
from livemig.testbed.stream import Stream
from livemig.testbed.tcpstream import TcpStream
from livemig.tls import creds as tls_creds
from livemig.tls import testbed as tls_testbed
from livemig.tls.creds import Tls

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 180.0
GUEST_OVERHEAD = 160 << 20  # kernel + initramfs + agent, on top of the workload's memory
LINK_EFFICIENCY = 0.93  # TCP payload over a tbf-shaped veth (measured: 93% at 1gbit)
FAULT_KINDS = faults.KINDS

__all__ = ["FAULT_KINDS", "Fault", "Interrupted", "LabRun", "MigrateOptions", "Running"]


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
    net: NetSpec = field(default_factory=NetSpec)  # the guest NIC's backend (--net)
    disk_fill: str = "zero"  # zero (sparse) | mixed: the source image starts full of data
    # ping-pong (livemig verify): which testbed hosts, an already running source to
    # migrate instead of booting one, and whether to hand the destination over
    src_host: str = "src"
    dst_host: str = "dst"
    source: Running | None = None
    keep_destination: bool = False
    images: tuple[Path, Path] | None = None  # disk images owned by the caller
    testbed_held: bool = False  # the caller holds the testbed lock
    trace_events: tuple[str, ...] = ()  # QEMU trace points on both ends (report: qemu_trace)
    # lab: the lab's engine hooks; attach: the lab boots and measures, then hands the two
    # QEMUs' QMP sockets to the attach path, which migrates them as a user's VMs
    via: str = "lab"
    # every QEMU gets the attach path's second QMP socket, whatever ``via`` (a ping-pong
    # that alternates paths hands a lab-path destination to an attach-path hop)
    attach_monitor: bool = False
    resume_corrupt: bool = False  # livemig verify --inject only: see Plan.resume_corrupt
    tls: str = "auto"  # --tls: auto = on between the testbed's hosts, off with --link local

    def plan(self, uri: str = "") -> Plan:
        """The engine's plan; validated before anything boots."""
        disk_link = None
        if self.storage == "copy" and self.testbed and self.link is not None:
            disk_link = self.link / 8 * LINK_EFFICIENCY
        return Plan(uri=uri, settings=tuple(self.wanted.items()), explicit=self.explicit,
                    profile=self.profile, bandwidth=self.bandwidth, max_time=self.max_time,
                    verify=self.verify, accel=self.accel,
                    pause_before_switchover=self.storage == "copy",
                    disk_link=disk_link, resume_corrupt=self.resume_corrupt).validate()


@dataclass
class Running:
    """A guest that runs on, handed from one migration to the next."""

    vm: VM
    agent: AgentLink
    host: str
    image: Path | None


class LabRun(Hooks):
    """One lab migration (``livemig migrate`` without ``--src-qmp``)."""

    def __init__(self, opts: MigrateOptions, progress: Progress | None = None) -> None:
        self.opts = opts
        self.progress = progress or Progress(enabled=False)
        self.id = opts.run_id or uuid.uuid4().hex[:8]
        self.run_dir = paths.run_root() / self.id
        self.events = EventStream()
        self.events.subscribe(progress_listener(self.progress))
        self.t0 = self.events.t0
        self.interrupt = asyncio.Event()
        self.plan = opts.plan()
        self.livemig = self.plan.livemig_settings()
        self.record: MigrationRecord | None = None
        self.engine: Engine | None = None
        self.src: VM | None = None
        self.dst: VM | None = None
        self.src_agent: AgentLink | None = None
        self.dst_agent: AgentLink | None = None
        self.t_ready: float | None = None
        self.qemu_trace: dict[str, Any] | None = None
        self.t_migrate: float | None = None
        self.t_end: float | None = None
        self.source_after: dict[str, Any] | None = None
        self.state = RunState(self.run_dir)
        self._mem_files: list[Path] = []
        self.copy: DiskCopy | None = None  # --storage copy
        self.prober: Prober | None = None
        self.stream: Stream | TcpStream | None = None  # --set client-stream=udp|tcp
        self.switches: dict[str, vswitch.Switch] = {}  # --net vhost-user: per host
        self.vhost: dict[str, Any] = {}  # what QEMU negotiated with the switch
        self.network: dict[str, Any] = {}
        self.disk_check: DiskComparison | None = None
        self._testbed = contextlib.ExitStack()
        self._testbed_created = False
        self._images: list[Path] = []  # created by this run, removed at its end
        self._src_image: Path | None = None
        self._dst_image: Path | None = None
        svc = opts.workload.service
        self.service = ServiceRun(svc, self.progress.step) if svc is not None else None
        self.injected: list[dict[str, Any]] = []
        self.adapted: Adapted | None = None  # the second plan, before dst boots
        self.encoding: dict[str, Any] | None = None

    def event(self, what: str, **data: Any) -> None:
        self.events.event(what, **data)

    # -- main -------------------------------------------------------------------------
    async def run(self) -> MigrationRecord:
        outcome, reason = "failed", None
        try:
            await self._boot()
            host = topology.MIG_ADDR[self.opts.dst_host] if self.opts.testbed else "127.0.0.1"
            assert self.adapted is not None
            plan = self.adapted.plan.with_uri(
                f"tcp:{host}:{_free_port()}").with_tls(self._tls())
            assert self.src is not None and self.dst is not None
            assert self.src.endpoint is not None and self.dst.endpoint is not None
            if self.opts.via == "attach":
                self.record = await self._attached(plan)
                if not self.record.completed and self.src.alive() \
                        and self.record.t_migrate is not None:
                    await self._source_after()
                return self.record
            self.engine = Engine(self.src.endpoint, self.dst.endpoint, plan,
                                 events=self.events, hooks=self, interrupt=self.interrupt,
                                 run_id=self.id, guardian_dir=self.run_dir,
                                 encoding=self.encoding)
            self.record = await self.engine.run()
            if not self.record.completed and self.src.alive() \
                    and self.record.t_migrate is not None:
                await self._source_after()
        except Interrupted as e:
            outcome, reason = "aborted", str(e)
        except UsageError:
            raise
        except (LivemigError, OSError) as e:
            outcome, reason = "failed", str(e)
            self.progress.step(f"failed: {e}")
        finally:
            self.t_end = time.time()
            if self.record is None:
                self.record = MigrationRecord(
                    run_id=self.id, uri="", t0=self.t0, t_migrate=None, t_ram=None,
                    t_end=self.t_end, t_dst_done=None, t_cont=None, outcome=outcome,
                    reason=reason, verify=self.opts.verify)
            await self._cleanup()
        self.record = dataclasses.replace(
            self.record, events=tuple(self.events.log),
            source_after={**(self.record.source_after or {}), **(self.source_after or {})}
            or None)
        return self.record

    async def _boot(self) -> None:
        o = self.opts
        reap()  # what runs that died left behind
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
        if o.workload.service is not None:
            ServiceRun.check(o.workload.service, o.testbed)
        private.make_dir(self.run_dir)
        self.event("phase booting")
        self.progress.step(f"run {self.id}: accel {o.accel} ({o.accel_reason}), "
                           f"QEMU {o.qemu}, logs in {self.run_dir}")
        if o.net.vhost_user and not o.testbed:
            raise UsageError("--net vhost-user needs the testbed's hosts (not --link local)")
        if o.testbed:
            self._testbed_up()
            if o.net.vhost_user:
                self._switches_up()
        if self.service is not None:
            created, self._src_image, self._dst_image = self.service.make_images(
                o.storage, self.run_dir, self.state)
        else:
            created, self._src_image, self._dst_image = make_images(
                o.workload, o.storage, self.run_dir, o.disk_size, o.disk_fill, self.state,
                self.events, o.images, o.source.image if o.source else None)
        self._images += created
        src_disks, dst_disks = disks(self._src_image), disks(self._dst_image)
        if o.source is not None:
            self.src, self.src_agent = o.source.vm, o.source.agent
            self._mem_files.append(self.src.config.mem_path)
            self.t_ready = time.time()
        else:
            self.src, self.src_agent = await self._launch("src", src_disks, incoming=False)
            self._check_interrupt()
            self.progress.step(f"source booting, workload {o.workload.text}")
            await self._wait_ready()
        if o.testbed:
            await self._start_probes()
            await self._start_stream(str(self.livemig.get("client-stream", "off")))
        if self.switches:
            self.vhost["src"] = await self._vhost_status(self.src)
        if self.service is not None:
            self.t_ready = await self.service.start(
                self._check_interrupt, self.src.config.console_path if self.src else None)
        if o.via == "attach":  # the attach path adapts the plan itself
            self.adapted = Adapted(self.plan, None)
        else:
            await self._adapt()
        self.dst, self.dst_agent = await self._launch("dst", dst_disks, incoming=True)

    def _tls(self) -> Tls | None:
        o = self.opts
        if not tls_creds.enabled(o.tls, one_host=not o.testbed):
            return None
        tls = (tls_testbed.tls(o.src_host, o.dst_host) if o.testbed
               else tls_testbed.tls(tls_testbed.LOCAL, tls_testbed.LOCAL))
        self.event("tls", **tls.as_dict())
        return tls

    # -- engine hooks -----------------------------------------------------------------
    def disk_targets(self) -> DiskTargets | None:
        if self.opts.storage != "copy":
            return None
        return DiskTargets(block_job=MIRROR_JOB, io_device=GUEST_DISK)

    async def warmup(self) -> None:
        warm = float(self.livemig["warmup"])
        self.progress.step(f"measuring the workload's normal rate for {warm:.0f}s")
        await self._sleep(warm)
        assert self.src is not None
        self.src.sample_threads()

    async def start_disk_copy(self) -> bool:
        """The migration starts: with ``--storage copy`` the mirror starts; disk first
        (``disk-schedule=first|libvirt``), the engine's monitor holds ``migrate`` until
        the mirror's first pass is done (:meth:`disk_observation` says ready)."""
        assert self.engine is not None
        self.t_migrate = self.engine.s.t_migrate  # the guest's baseline ends here
        if self.opts.storage != "copy":
            return False
        assert self.src is not None and self.dst is not None
        self.copy = DiskCopy(self.src, self.dst, topology.MIG_ADDR[self.opts.dst_host],
                             self.livemig, self.events, self.progress.step,
                             tls=self.engine.plan.tls is not None)
        await self.copy.start()
        return self.livemig["disk-schedule"] in ("first", "libvirt")

    async def before_ram(self) -> None:
        if self.opts.testbed and not self.switches:  # packets to/from the guest so far
            self.network["tap_packets_at_migration"] = \
                topology.tap_counters(self.opts.src_host)
        if self.switches:  # which queue pairs carried the guest's traffic so far
            self.vhost["src_queue_packets"] = \
                self.switches[self.opts.src_host].queue_counters()
            self.vhost["src_port_drops"] = self.switches[self.opts.src_host].drop_counters()

    async def on_poll(self, now: float, obs: Observation) -> dict[str, Any]:
        assert self.src is not None
        self.src.sample_threads()
        if self.copy is not None and self.disk is not None and self.disk.active \
                and not obs.terminal:
            await self.copy.poll(now)
        if self.switches and not self.vhost.get("log_enabled_seen") and not obs.terminal:
            st = await self._vhost_status(self.src)
            if st.get("log_enabled"):
                self.vhost["log_enabled_seen"] = True
                self.event("vhost-user dirty log on", log_size=st.get("log_size"))
        extra: dict[str, Any] = {"guest_rate": self._guest_rate()}
        if self.copy is not None and self.copy.remaining is not None:
            extra["remaining_disk"] = self.copy.remaining
        base = self._baseline()
        if extra["guest_rate"] is not None and base:
            extra["guest_rate_pct"] = 100.0 * extra["guest_rate"] / base
        return extra

    def disk_observation(self) -> dict[str, Any] | None:
        return (self.copy.obs or None) if self.copy is not None else None

    async def pre_switchover(self) -> bool:
        if self.copy is None or self.disk is None or not self.disk.active:
            return False
        await self.copy.switchover(self._check_interrupt)
        return True

    @property
    def disk(self) -> DiskMirror | None:
        return self.copy.mirror if self.copy is not None else None

    def destination_dead(self) -> str | None:
        if self.dst is not None and not self.dst.alive():
            return f"destination QEMU died: {self.dst.log_tail()}"
        return None

    def guardian_extra(self) -> dict[str, Any]:
        if self.opts.storage != "copy":
            return {}
        return {"block_job": MIRROR_JOB, "io_throttle_device": GUEST_DISK}

    async def before_verify(self) -> None:
        if self.disk is not None:
            await self.disk.stop_export()
        if self.opts.verify:
            for fault in self.opts.faults:
                self._inject(fault)

    async def verify_more(self) -> str | None:
        if self.disk is None:
            return None
        self.progress.step("comparing the disk images: source vs destination")
        assert self._src_image is not None and self._dst_image is not None
        self.disk_check = await asyncio.to_thread(
            compare_images, self._src_image, self._dst_image)
        self.event("disk compared", **self.disk_check.as_dict())
        if self.disk_check.ok:
            return None
        first = ", ".join(f"{o:#x}" for o in self.disk_check.first_mismatches[:4])
        n = self.disk_check.mismatched_blocks
        return (f"destination disk differs from the source in {n} "
                f"block{'' if n == 1 else 's'} (first: {first})")

    async def after_resume(self) -> None:
        assert self.dst is not None
        if self.opts.testbed:
            # QEMU announced the guest's MAC when the migration completed, while we
            # held the guest; say it again now that it runs, so switches learn it
            with contextlib.suppress(VMError):
                await self.dst.cmd("announce-self", initial=50, max=550, rounds=5, step=100)
        taps_before = self._tap_counters()
        t_settle = time.time()
        if self.switches:
            self.vhost["dst"] = await self._vhost_status(self.dst)
        await self._sleep(float(self.livemig["settle"]), interruptible=False)
        self._who_answers(taps_before, t_settle)

    async def after_failure(self) -> None:
        if self.disk is not None:
            await self.disk.abandon()

    # -- boot -------------------------------------------------------------------------
    async def _launch(self, name: str, disks: list[Disk],
                      incoming: bool) -> tuple[VM, AgentLink]:
        """Start one end's QEMU and connect to its monitor and its guest agent. The
        attributes are set as soon as each exists, so cleanup finds them on failure."""
        vm = VM(self._vm_config(name, disks, incoming))
        setattr(self, name, vm)
        vm.start()
        self.state.add_qemu(name, vm.pid)
        await vm.connect()
        agent = AgentLink(name, vm.config.agent_path)
        setattr(self, f"{name}_agent", agent)
        await agent.connect()
        return vm, agent

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

    def _switches_up(self) -> None:
        """--net vhost-user: a switch on each host this run uses, before QEMU starts
        (QEMU serves the socket and waits until its switch connects)."""
        o = self.opts
        cpu = vswitch.pmd_cpu()
        for host in dict.fromkeys((o.src_host, o.dst_host)):
            sw = vswitch.Switch(host, topology.HOSTS[host], self.run_dir,
                                tag=f"livemig-{self.id}-{host}")
            self.switches[host] = sw
            try:
                sw.start(cpu)
            finally:
                for i, pid in enumerate(sw.pids()):
                    self.state.add_qemu(f"switch-{host}-{i}", pid)
        self.event("vhost-user switches", hosts=list(self.switches), queues=o.net.queues)
        self.progress.step(f"vhost-user switch (Open vSwitch + DPDK) on "
                           f"{', '.join(self.switches)}, {o.net.queues} queue pair(s)")

    def _switches_down(self) -> None:
        for sw in self.switches.values():
            sw.stop()

    async def _vhost_status(self, vm: VM | None) -> dict[str, Any]:
        """What QEMU's vhost-user device negotiated: dirty logging through a shared
        fd (VHOST_USER_PROTOCOL_F_LOG_SHMFD) is what lets the switch's writes into
        guest RAM be migrated."""
        if vm is None:
            return {}
        try:
            devs = await vm.cmd("x-query-virtio")
            path = next(d["path"] for d in devs if d["name"] == "virtio-net")
            st = await vm.cmd("x-query-virtio-status", path=path)
        except (VMError, StopIteration, KeyError) as e:
            return {"error": str(e)}
        dev = st.get("vhost-dev") or {}
        protocols = " ".join(dev.get("protocol-features", {}).get("protocols", []))
        features = " ".join(dev.get("features", {}).get("dev-features", []))
        return {"log_shmfd": "VHOST_USER_PROTOCOL_F_LOG_SHMFD" in protocols,
                "log_all": "VHOST_F_LOG_ALL" in features,
                "mq": "VIRTIO_NET_F_MQ" in " ".join(
                    dev.get("acked-features", {}).get("dev-features", [])),
                "log_enabled": bool(dev.get("log-enabled")),
                "log_size": dev.get("log-size")}

    async def _start_stream(self, mode: str) -> None:
        """``--set client-stream=udp|tcp``: the client's stream to the guest."""
        if mode == "udp":
            self.stream = Stream()
            self.stream.start()
            self.progress.step("client streams UDP datagrams to the guest's echo")
        elif mode == "tcp":
            tcp = TcpStream()
            try:
                await asyncio.to_thread(tcp.start)
            except OSError as e:
                raise VMError(f"the guest's TCP sink at {tcp.target[0]}:{tcp.target[1]} "
                              f"does not accept the client's connection: {e}") from e
            self.stream = tcp
            self.progress.step(f"client streams TCP to the guest's sink "
                               f"({tcp.target[0]}:{tcp.target[1]})")

    def _stream_summary(self) -> dict[str, Any]:
        assert self.stream is not None
        end = self.t_end or time.time()
        if isinstance(self.stream, Stream):
            return self.stream.summary(self.t_ready or end, self.t_migrate, end)
        rec = self.record
        out = self.stream.summary(self.t_migrate, rec.t_dst_done if rec else None,
                                  rec.t_cont if rec else None, end, self._hold())
        out.update(self._sink_view(rec.t_cont if rec else None))
        return out

    def _sink_view(self, t_cont: float | None) -> dict[str, Any]:
        """What the guest's sink counted: bytes received after the destination
        resumed (its agent's counter) and how the connection ended on its side."""
        events = [e for a in (self.src_agent, self.dst_agent) if a for e in a.tcp_events]
        closes = [e for e in events if e.get("ev") == "tcp_close"]
        after = None
        if self.dst_agent is not None and t_cont is not None:
            # the counter moved with the guest: the source's last report is the base
            rates = [r.net_bytes for r in self.dst_agent.rates if r.t >= t_cont]
            before = [r.net_bytes for a in (self.src_agent, self.dst_agent) if a
                      for r in a.rates if r.t < t_cont]
            if rates:
                after = max(rates) - (max(before) if before else min(rates))
        return {"guest_connections": sum(1 for e in events if e.get("ev") == "tcp_open"),
                "guest_bytes_after_switchover": after,
                "guest_close": [{k: e.get(k) for k in ("conn", "bytes", "how", "errno")}
                                for e in closes]}

    async def _start_probes(self) -> None:
        """The client starts probing the guest; it must answer before we migrate."""
        self.prober = Prober()
        self.prober.start()
        deadline = time.monotonic() + 15
        while not self.prober.stats.replies:
            self._check_interrupt()
            if time.monotonic() > deadline:
                raise VMError(f"the guest does not answer the client's probes at "
                              f"{topology.GUEST_IP} (console: {self.src.config.console_path})"
                              if self.src else "no guest")
            await asyncio.sleep(0.05)
        self.progress.step(f"client probes the guest at {topology.GUEST_IP} every "
                           f"{self.prober.interval * 1000:.0f} ms")

    async def _attached(self, plan: Plan) -> MigrationRecord:
        """``via=attach``: measure the guest's normal rate, then migrate the two QEMUs
        through the attach path (their second QMP sockets), as a user's VMs: no lab
        hook, the attach path's own sampler and checks."""
        assert self.src is not None and self.dst is not None
        await self.warmup()
        # nothing of the testbed's link either: the attach path reads it from the
        # source host's route to the destination (engine/linkprobe.py), as for a user's VM
        self.progress.step("handing both QEMUs' QMP sockets to the attach path")
        rec, _ = await run_attach(self.src.config.attach_qmp_path,
                                  self.dst.config.attach_qmp_path, plan, self.events,
                                  self.interrupt)
        self.t_migrate = rec.t_migrate
        self.encoding = rec.encoding
        return rec

    async def _adapt(self) -> None:
        """The second plan (:func:`livemig.engine.adapt.adapt`): the stream encoding
        from a sample of the guest's pages, taken through the same sampler an attach
        run would use (``--set sampler=file`` reads the lab's RAM file instead), and
        the profile fitted to this QEMU."""
        assert self.src is not None and self.src.endpoint is not None
        o = self.opts
        hints = Hints(link_rate=o.link / 8 if o.testbed and o.link else None,
                      file_sampler=pagesample.FileSampler(self.src.config.mem_path),
                      scratch=self.run_dir,
                      tls=tls_creds.enabled(o.tls, one_host=not o.testbed),
                      idle=idlecpu.local(),
                      dst_local=True)  # both QEMUs of a lab run share this host
        self.adapted = await adapt(self.src.endpoint, self.plan, hints, self.events)
        self.encoding = self.adapted.encoding

    def _vm_config(self, name: str, disks: list[Disk], incoming: bool) -> VMConfig:
        """``name`` is the role (src/dst); the testbed host comes from the options."""
        o = self.opts
        mem_path = paths.shm_root() / f"livemig-{self.id}-{name}.ram"
        private.create_exclusive(mem_path)  # QEMU opens the file made here, 0600
        self._mem_files.append(mem_path)
        self.state.add_file(mem_path)
        append = "console=ttyS0 quiet " + (
            ServiceRun.kernel_append() if self.service is not None
            else f"livemig.workload={o.workload.text}")
        prefix: list[str] = []
        extra: list[str] = []
        if o.testbed:
            host = o.src_host if name == "src" else o.dst_host
            prefix = netns.exec_prefix(topology.HOSTS[host])
            sw = self.switches.get(host)
            extra = o.net.qemu_args(topology.GUEST_MAC, topology.TAP,
                                    sw.socket if sw is not None else None)
            append += f" livemig.ip={topology.GUEST_IP}/{topology.GUEST_PREFIX}"
        return VMConfig(
            name=name, run_id=self.id, qemu=o.qemu, memory=o.memory, vcpus=o.vcpus, accel=o.accel,
            kernel=paths.guest_kernel(), initrd=paths.guest_initrd(), append=append,
            run_dir=self.run_dir, mem_path=mem_path, incoming=incoming,
            start_paused=incoming and o.verify, disks=disks,
            exec_prefix=prefix, extra_args=extra, trace_events=o.trace_events,
            attach_qmp=o.via == "attach" or o.attach_monitor,
        )

    async def _wait_ready(self) -> None:
        assert self.src is not None and self.src_agent is not None
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not self.src_agent.ready.is_set():
            self._check_interrupt()
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

    def _all_rates(self) -> list[Any]:
        if self.service is not None:  # what the service's client completed
            return self.service.samples()
        rates: list[Any] = []
        for a in (self.src_agent, self.dst_agent):
            if a is not None:
                rates += a.rates
        return rates

    def _guest_rate(self) -> float | None:
        now = time.time()
        window = 2.5 if self.service is not None else 1.0  # a client reports once a second
        return metrics.average_rate(self._all_rates(), now - window, now)

    def _baseline(self) -> float | None:
        if self.t_ready is None or self.t_migrate is None:
            return None
        return metrics.average_rate(self._all_rates(), self.t_ready, self.t_migrate)

    def _tap_counters(self) -> dict[str, dict[str, int]] | None:
        """Packets through the guest's port on each host: its tap, or with vhost-user
        the switch's port for it (rx = sent by the guest, on both)."""
        if not self.opts.testbed:
            return None
        o = self.opts
        if self.switches:
            return {side: self.switches[host].counters()
                    for side, host in (("src", o.src_host), ("dst", o.dst_host))}
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
        port = "switch port" if self.switches else "tap"
        self.network["after_switchover"] = {
            "answered_by": answered, "replies": replies,
            f"packets_from_guest_on_dst_{port.split()[-1]}": dst_tx,
            f"packets_from_guest_on_src_{port.split()[-1]}": src_tx,
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

    async def _source_after(self) -> None:
        """After a cancel or failure: the destination goes, the source's guest works."""
        assert self.src is not None
        if self.dst is not None:
            self.dst.kill()
        after: dict[str, Any] = {}
        t = time.time()
        await self._sleep(float(self.livemig["settle"]), interruptible=False)
        src_rates = self.src_agent.rates if self.src_agent else []
        after["workload_rate"] = metrics.average_rate(src_rates, t, time.time())
        after["destination_alive"] = bool(self.dst and self.dst.alive())
        self.source_after = after
        self.event("source after", **after)

    async def _sleep(self, seconds: float, interruptible: bool = True) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if interruptible:
                self._check_interrupt()
            await asyncio.sleep(min(0.05, end - time.monotonic()) if end > time.monotonic()
                                else 0)

    def _check_interrupt(self) -> None:
        if self.interrupt.is_set():
            raise Interrupted("interrupted")

    async def _cleanup(self) -> None:
        if self.service is not None:
            await self.service.stop()
        self.progress.close()
        if self.stream is not None:
            await asyncio.to_thread(self.stream.stop)
            if isinstance(self.stream, TcpStream):  # the guest's tcp_close line
                await self._sleep(0.3, interruptible=False)
            self.network["stream"] = self._stream_summary()
        if self.prober is not None:
            self.prober.stop()
            self.network.update(self.prober.summary(
                self.t_migrate or self.prober.started or time.time(),
                self.t_end or time.time(), self._hold()))
        keep = self.handed_over() or self.source_kept()
        if keep is not None:
            self._mem_files.remove(keep.vm.config.mem_path)
        for agent in (self.src_agent, self.dst_agent):
            if agent is not None and (keep is None or agent is not keep.agent):
                await agent.close()
        for vm in (self.dst, self.src):
            if vm is not None and (keep is None or vm is not keep.vm):
                with contextlib.suppress(Exception):
                    await vm.stop()
        if self.opts.trace_events and self.src is not None and self.dst is not None:
            self.qemu_trace = qemutrace.summarize(
                qemutrace.read(self.src.config.trace_path),
                qemutrace.read(self.dst.config.trace_path), self.t_migrate)
        for f in self._mem_files:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        for img in self._images:
            with contextlib.suppress(FileNotFoundError):
                img.unlink()
        self._switches_down()
        self.state.remove()  # nothing of this run is left for a later command to reap
        if self._testbed_created:
            topology.down(quiet=True)
        self._testbed.close()
        if self.record is not None and self.record.completed and not self.opts.keep_run_dir:
            # this run's directory, and that of a source handed over by an earlier run,
            # unless a guest handed over to the next run still has its sockets there
            dirs = {self.run_dir} | {vm.config.run_dir for vm in (self.src, self.dst) if vm}
            if keep is not None:
                dirs.discard(keep.vm.config.run_dir)
            for d in dirs:
                shutil.rmtree(d, ignore_errors=True)

    def handed_over(self) -> Running | None:
        """With ``keep_destination``: the guest now running on the destination."""
        if not self.opts.keep_destination or self.record is None or not self.record.completed:
            return None
        if self.dst is None or self.dst_agent is None or not self.dst.alive():
            return None
        return Running(self.dst, self.dst_agent, self.opts.dst_host, self._dst_image)

    def source_kept(self) -> Running | None:
        """With ``keep_destination`` (a ping-pong), a migration that did not complete
        leaves the guest running on its source: kept for the caller, not stopped."""
        o = self.opts
        if not o.keep_destination or (self.record is not None and self.record.completed):
            return None
        if self.src is None or self.src_agent is None or not self.src.alive():
            return None
        if o.source is None and (self.record is None or self.record.t_migrate is None):
            return None  # failed while booting: nothing the caller had
        return Running(self.src, self.src_agent, o.src_host, self._src_image)

    def _hold(self) -> tuple[float, float] | None:
        return self.record.hold if self.record is not None else None

    # -- results ----------------------------------------------------------------------
    def facts(self) -> LabFacts:
        """What the lab measured, for the report (read after :meth:`run`)."""
        o = self.opts
        rec = self.record
        wl: dict[str, Any] = {"spec": o.workload.text}
        if self.t_ready is not None and self.t_migrate is not None:
            end = self.t_end or self.t_migrate
            hold = rec.hold if rec is not None else None
            if self.service is not None and self.service.load is not None:
                wl.update(self.service.workload(self.t_ready, self.t_migrate, end, hold,
                                                rec.t_cont if rec is not None else None))
            else:
                wl.update(metrics.workload_stats(self._all_rates(), self.t_ready,
                                                 self.t_migrate, end, hold).as_dict())
        agents = [a for a in (self.src_agent, self.dst_agent) if a]
        wl["guest_agent_errors"] = sum(len(a.errors) for a in agents)
        guest_errors = [e for a in agents for e in a.verify_errors
                        if e.get("t", self.t0) >= self.t0]  # a handed-over agent has older ones
        disk: dict[str, Any] = {"disk_transferred_bytes": 0, "disk_dirty_amplification": None}
        if self.disk is not None:
            disk = self.disk.stats.as_report()
        disk_check: dict[str, Any] = {"result": "skipped", "why": f"storage {o.storage}"}
        if self.disk_check is not None:
            disk_check = self.disk_check.as_dict()
        return LabFacts(
            workload=wl, pause=self.pause(), disk=disk,
            network={**self.network, **({"vhost_user": self.vhost} if self.vhost else {})},
            disk_check=disk_check,
            guest="mismatch" if guest_errors else ("ok" if o.workload.verify else "skipped"),
            guest_errors=guest_errors,
            migration_thread_cpu=round(self.src.migration_thread_cpu(), 3) if self.src else None,
            encoding=self.encoding,
            qemu_trace=self.qemu_trace,
            settings={
                "memory": o.memory, "vcpus": o.vcpus, "qemu": str(o.qemu),
                "testbed": o.testbed, "link_bits": o.link if o.testbed else None,
                "storage": o.storage, "accel_reason": o.accel_reason,
                "net": o.net.text if o.testbed else None,
                "faults": self.injected or [
                    {"kind": f.kind, "address": f"{f.address:#x}"} for f in o.faults],
                "total_time_includes_disk_copy": self.disk is not None,
                "via": o.via,
            })

    def report(self) -> dict[str, Any]:
        assert self.record is not None
        return build_report(self.record, self.facts())

    def pause(self) -> dict[str, float | None]:
        """Longest guest-visible silence, minus the time the guest was held for the
        RAM comparison (which a real migration does not have)."""
        beats: list[float] = []
        for a in (self.src_agent, self.dst_agent):
            if a is not None:
                beats += a.heartbeats
        if self.t_migrate is None:
            return {"guest_pause_ms": None, "guest_pause_raw_ms": None, "verify_hold_ms": None}
        rec = self.record
        t_cont = rec.t_cont if rec else None
        t_dst_done = rec.t_dst_done if rec else None
        end = (t_cont or self.t_end or time.time()) + 1.0
        gap = metrics.longest_gap(beats, self.t_migrate, end)
        hold = None
        if t_cont is not None and t_dst_done is not None:
            hold = t_cont - t_dst_done
        raw = gap.seconds if gap else None
        pause = raw
        if gap and hold is not None and t_dst_done is not None \
                and gap.start <= t_dst_done <= gap.end:
            pause = max(gap.seconds - hold, 0.0)
        return {
            "guest_pause_ms": _ms(pause),
            "guest_pause_raw_ms": _ms(raw),
            "verify_hold_ms": _ms(hold),
        }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000.0, 1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


