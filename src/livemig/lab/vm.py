"""One QEMU process: its command line, its life cycle and its QMP monitor.

A VM here is always one of the two ends of a migration. Both ends get the same
devices; the destination additionally waits for ``migrate-incoming`` (``-incoming
defer``) and may be told not to start by itself after the migration (``-S``) so
that its RAM can be compared with the source's before the guest runs again.

No QEMU's life hangs on livemig's: each runs in its own session (no SIGKILL when
livemig dies, no Ctrl-C from livemig's terminal); the run's state file
(:mod:`livemig.lab.leftovers`) lets the next livemig command clean up after a run
that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from livemig import private
from livemig.engine.endpoint import Endpoint
from livemig.engine.pinning import is_migration_thread
from livemig.errors import VMError
from livemig.lab import qemutrace
from livemig.paths import FIRMWARE_DIRS

log = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK")
AGENT_PORT_NAME = "org.livemig.agent0"


@dataclass(frozen=True)
class Disk:
    """A raw disk image attached as virtio-blk (node name = ``node``)."""

    path: Path
    node: str = "disk0"
    fmt: str = "raw"


@dataclass
class VMConfig:
    name: str  # "src" or "dst"
    run_id: str
    qemu: Path
    memory: int  # bytes
    vcpus: int
    accel: str
    kernel: Path
    initrd: Path
    append: str
    run_dir: Path
    mem_path: Path
    incoming: bool = False  # destination: -incoming defer
    start_paused: bool = False  # -S: do not run the guest after an incoming migration
    attach_qmp: bool = False  # a second QMP monitor for the attach path (bench via attach)
    disks: list[Disk] = field(default_factory=list)
    exec_prefix: list[str] = field(default_factory=list)  # e.g. ip netns exec lm-src
    extra_args: list[str] = field(default_factory=list)
    trace_events: tuple[str, ...] = ()  # QEMU trace points logged to trace_path
    prealloc_threads: int = 0  # > 0: prealloc=on with this many threads (start-time study)

    @property
    def trace_path(self) -> Path:
        return self.run_dir / f"{self.name}.trace"

    @property
    def qmp_path(self) -> Path:
        return self.run_dir / f"{self.name}.qmp"

    @property
    def attach_qmp_path(self) -> Path:
        return self.run_dir / f"{self.name}-attach.qmp"

    @property
    def agent_path(self) -> Path:
        return self.run_dir / f"{self.name}.agent"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    @property
    def console_path(self) -> Path:
        return self.run_dir / f"{self.name}.console"

    def argv(self) -> list[str]:
        mib = self.memory >> 20
        argv = [str(self.qemu), "-name", f"livemig-{self.run_id}-{self.name},debug-threads=on"]
        for d in FIRMWARE_DIRS:
            argv += ["-L", str(d)]
        argv += [
            "-nodefaults", "-no-user-config", "-display", "none",
            "-accel", accel_arg(self.accel, self.vcpus),
            "-machine", "q35,memory-backend=ram0",
            "-object",
            f"memory-backend-file,id=ram0,size={mib}M,mem-path={self.mem_path},share=on"
            + (f",prealloc=on,prealloc-threads={self.prealloc_threads}"
               if self.prealloc_threads > 0 else ""),
            "-m", f"{mib}M",
            "-smp", str(self.vcpus),
            "-kernel", str(self.kernel), "-initrd", str(self.initrd),
            "-append", self.append,
            "-serial", f"file:{self.console_path}",
            "-chardev", f"socket,id=qmp,path={self.qmp_path},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
            "-device", "virtio-serial-pci,id=vser0",
            "-chardev", f"socket,id=agentch,path={self.agent_path},server=on,wait=off",
            "-device", f"virtserialport,bus=vser0.0,chardev=agentch,name={AGENT_PORT_NAME}",
        ]
        if self.accel == "kvm":
            argv += ["-cpu", "host"]
        for i, disk in enumerate(self.disks):
            argv += [
                "-blockdev",
                f"driver=file,filename={disk.path},node-name={disk.node}-file,"
                "cache.direct=off,aio=threads",
                "-blockdev", f"driver={disk.fmt},file={disk.node}-file,node-name={disk.node}",
                "-device", f"virtio-blk-pci,drive={disk.node},id=vdisk{i}",
            ]
        if self.trace_events:
            argv += qemutrace.trace_args(self.trace_path, self.trace_events)
        if self.attach_qmp:
            argv += ["-chardev",
                     f"socket,id=qmp2,path={self.attach_qmp_path},server=on,wait=off",
                     "-mon", "chardev=qmp2,mode=control"]
        if self.incoming:
            argv += ["-incoming", "defer"]
        if self.start_paused:
            argv += ["-S"]
        return self.exec_prefix + argv + self.extra_args


class VM:
    """A running QEMU process with its QMP connection."""

    def __init__(self, config: VMConfig) -> None:
        self.config = config
        self.name = config.name
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint: Endpoint | None = None
        self.started_at: float | None = None
        self._thread_cpu: dict[int, tuple[str, float]] = {}

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        for p in (cfg.qmp_path, cfg.agent_path):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        argv = cfg.argv()
        log.info("%s: starting: %s", self.name, " ".join(argv))
        logf = os.fdopen(private.open_file(cfg.log_path), "wb")  # handed to the child
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, umask=private.CHILD_UMASK,
            )
        except OSError as e:
            raise VMError(f"{self.name}: cannot run {argv[0]}: {e.strerror}") from e
        finally:
            logf.close()
        self.started_at = time.time()

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.config.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def qmp(self) -> QMPClient | None:
        return self.endpoint.qmp if self.endpoint is not None else None

    async def connect(self, timeout: float = 30.0) -> Endpoint:
        """Connect to QMP once the socket appears; fail early if QEMU exits."""
        end = Endpoint(self.name, self.config.qmp_path, alive=self.alive, pid=self.pid,
                       ram_file=self.config.mem_path)
        try:
            await end.connect(timeout)
        except VMError as e:
            tail = self.log_tail()
            raise VMError(f"{e}" + (f": {tail}" if tail else "")) from e
        self.endpoint = end
        return end

    async def cmd(self, command: str, **args: Any) -> Any:
        if self.endpoint is None:
            raise VMError(f"{self.name}: not connected")
        return await self.endpoint.cmd(command, **args)

    async def stop(self, timeout: float = 5.0) -> None:
        """Quit QEMU politely, then kill it."""
        if self.endpoint is not None and self.endpoint.qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.endpoint.cmd("quit"), 2.0)
            await self.endpoint.close()
        self.kill(timeout)

    def kill(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=0.5 if timeout else 0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=timeout)

    # -- accounting -------------------------------------------------------------------
    def cpu_seconds(self) -> float | None:
        """User+system CPU seconds of the whole process so far."""
        if not self.alive():
            return None
        return _stat_cpu(Path(f"/proc/{self.pid}/stat"))

    def sample_threads(self) -> None:
        """Remember each thread's CPU time (threads end with the migration)."""
        if not self.alive():
            return
        task_dir = Path(f"/proc/{self.pid}/task")
        try:
            tids = list(task_dir.iterdir())
        except OSError:
            return
        for t in tids:
            try:
                comm = (t / "comm").read_text().strip()
                cpu = _stat_cpu(t / "stat")
            except OSError:
                continue
            if cpu is not None:
                self._thread_cpu[int(t.name)] = (comm, cpu)

    def threads(self) -> dict[int, str]:
        """Thread id → name of the running QEMU."""
        out: dict[int, str] = {}
        if not self.alive():
            return out
        try:
            for t in Path(f"/proc/{self.pid}/task").iterdir():
                try:
                    out[int(t.name)] = (t / "comm").read_text().strip()
                except OSError:
                    continue
        except OSError:
            pass
        return out

    def migration_thread_cpu(self) -> float:
        """CPU seconds of QEMU's migration threads seen so far (main + multifd)."""
        return sum(cpu for comm, cpu in self._thread_cpu.values() if is_migration_thread(comm))


def _stat_cpu(path: Path) -> float | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is state (field 3); utime, stime are fields 14, 15
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def accel_arg(accel: str, vcpus: int) -> str:
    """``-accel`` for a lab guest. Under TCG a guest with several vCPUs runs them
    round-robin in one host thread (``thread=single``) rather than multi-threaded TCG:
    on the 2-vCPU testbed guests MTTCG crashed QEMU 10.2.2 at boot (``iotlb_to_section:
    Assertion `section_index < d->map.sections_nb' failed``, a TCG race between a vCPU
    and a memory-map update) in CI, and is the suspect of a rare RAM mismatch in the
    same guests (caught, the destination never ran). KVM guests are not affected;
    the guest still sees every vCPU (and uses every queue of a multiqueue NIC)."""
    if accel == "tcg" and vcpus > 1:
        return "tcg,thread=single"
    return accel
