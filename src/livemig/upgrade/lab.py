"""``livemig upgrade`` of a lab guest: boot on binary A, run the workload, upgrade in
place to binary B, measure it like a migration.

The lab's own pieces are reused through :class:`livemig.lab.run.LabRun` (testbed
lock, disks, boot, guest agent, client probes, clean-up, report); only the middle
differs: instead of the engine's migration, :class:`livemig.upgrade.switch.Upgrade`.
The guest's RAM is a shared file in /dev/shm (as for every lab guest) and the machine
gets ``aux-ram-share=on`` so that its ROMs and ACPI tables are memfds CPR can pass on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

from livemig.engine.record import MigrationRecord
from livemig.errors import LivemigError, UsageError, VMError
from livemig.lab.agent import AgentLink
from livemig.lab.disk import disks, make_images
from livemig.lab.run import LabRun, MigrateOptions
from livemig.lab.vm import VM, Disk, VMConfig
from livemig.progress import Progress
from livemig.upgrade import procfs
from livemig.upgrade.switch import Request, Result, Upgrade

WARMUP_S = 3.0  # the workload's normal rate, before the switch
SETTLE_S = 3.0  # the workload and the probes after it
AGENT_POLL_S = 0.001
AUX_RAM_SHARE = ["-machine", "aux-ram-share=on"]


class UpgradeLab(LabRun):
    """Boot a lab guest on ``opts.qemu`` and upgrade it in place (``request``)."""

    def __init__(self, opts: MigrateOptions, request: Request, aux_ram_share: bool = True,
                 progress: Progress | None = None, warmup: float = WARMUP_S,
                 settle: float = SETTLE_S) -> None:
        super().__init__(opts, progress)
        self.request = dataclasses.replace(request, work_dir=self.run_dir / "upgrade")
        self.aux_ram_share = aux_ram_share
        self.warmup_s = warmup
        self.settle_s = settle
        self.result: Result | None = None
        self.counters: dict[str, Any] = {}
        self.t_issue: float | None = None

    def _vm_config(self, name: str, disks: list[Disk], incoming: bool) -> VMConfig:
        cfg = super()._vm_config(name, disks, incoming)
        extra = list(cfg.extra_args)
        if self.aux_ram_share:  # without it CPR refuses (ROMs, ACPI tables)
            extra += AUX_RAM_SHARE
        return dataclasses.replace(cfg, extra_args=extra)

    async def upgrade(self) -> dict[str, Any]:
        """The whole run; returns the report."""
        outcome, reason = "failed", None
        try:
            await self._boot_source()
            self.progress.step(f"workload running; measuring its rate for {self.warmup_s:g}s")
            await self._sleep(self.warmup_s)
            before = self._last_work()
            assert self.src is not None and self.src.endpoint is not None
            up = Upgrade(self.src.endpoint, self.request, events=self.events,
                         watch=self._reconnect_agent)
            self.t_migrate = time.time()
            self.progress.step(f"upgrading in place to {self.request.to_qemu}")
            self.result = res = await up.run()
            self.t_issue = res.t_issue
            outcome, reason = res.outcome, res.reason
            if res.outcome == "completed":
                self._adopt(res)
                await self._sleep(self.settle_s, interruptible=False)
                self.counters = {"work_before": before, "work_after": self._last_work(),
                                 "agent_after": self._beats_after(res.t_running)}
                self._answered(res)
                self.progress.step(
                    f"upgraded ({res.mode}): QEMU downtime {res.downtime_ms} ms, "
                    f"pause breakdown {res.breakdown}")
            else:
                self.progress.step(f"upgrade failed: {reason}; the old QEMU runs the guest")
                await self._sleep(self.settle_s, interruptible=False)
                self.counters = {"work_before": before, "work_after": self._last_work()}
        except UsageError:  # Refused too: the old QEMU runs on untouched
            raise
        except (LivemigError, OSError) as e:
            outcome, reason = "failed", str(e)
            self.progress.step(f"failed: {e}")
        finally:
            self.t_end = time.time()
            self.record = MigrationRecord(
                run_id=self.id, uri=self.result.mode if self.result else "", t0=self.t0,
                t_migrate=self.t_issue or self.t_migrate, t_ram=None, t_end=self.t_end,
                t_dst_done=None, t_cont=None, outcome=outcome, reason=reason,
                final_stats=self.result.final_stats if self.result else {},
                verify=False)
            await self._cleanup()
        return self._report()

    async def _boot_source(self) -> None:
        o = self.opts
        from livemig import paths
        from livemig.lab.leftovers import reap

        reap()
        paths.require_file(o.qemu, "QEMU binary", "pass --from-qemu")
        paths.require_file(self.request.to_qemu, "QEMU binary", "pass --to-qemu")
        paths.require_file(paths.guest_kernel(), "guest kernel", "run 'make setup'")
        paths.require_file(paths.guest_initrd(), "guest initrd", "run 'make setup'")
        need = o.workload.mem_bytes + (160 << 20)
        if need > o.memory:
            raise UsageError(f"workload needs about {need >> 20} MiB of guest RAM but "
                             f"--memory is {o.memory >> 20} MiB")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.progress.step(f"run {self.id}: QEMU {o.qemu} -> {self.request.to_qemu}, logs "
                           f"in {self.run_dir}")
        if o.testbed:
            self._testbed_up()
        created, self._src_image, self._dst_image = make_images(
            o.workload, "shared", self.run_dir, o.disk_size, o.disk_fill, self.state,
            self.events, None, None)
        self._images += created
        self.src, self.src_agent = await self._launch("src", disks(self._src_image),
                                                      incoming=False)
        self.progress.step(f"guest booting, workload {o.workload.text}")
        await self._wait_ready()
        if o.testbed:
            await self._start_probes()

    async def _reconnect_agent(self, pid: int) -> None:
        """Connect to the guest agent as soon as the new QEMU listens on its socket
        (heartbeats written while nobody listens are lost: the sooner, the truer the
        measured pause)."""
        assert self.src is not None
        path = str(self.src.config.agent_path)
        same = pid == self.src.pid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if same and self.src_agent is not None and not self.src_agent.closed.is_set():
                await asyncio.sleep(AGENT_POLL_S)  # cpr-exec: the old image still serves
                continue
            if path in procfs.listening_unix_paths(pid):
                break
            await asyncio.sleep(AGENT_POLL_S)
        agent = AgentLink("dst", Path(path))
        with contextlib.suppress(VMError):
            await agent.connect(timeout=30)
            self.dst_agent = agent

    def _adopt(self, res: Result) -> None:
        """The lab's VM objects follow the guest: cpr-exec keeps the process, the other
        modes hand it to a new one (cleaned up like a destination)."""
        assert self.src is not None
        if res.mode == "cpr-exec":
            self.src.endpoint = res.new_endpoint
            return
        cfg = dataclasses.replace(self.src.config, name="dst", qemu=self.request.to_qemu)
        vm = VM(cfg)
        vm.proc = res.new_proc
        vm.endpoint = res.new_endpoint
        vm.started_at = res.t_issue
        self.dst = vm
        if vm.pid is not None:
            self.state.add_qemu("dst", vm.pid)

    def _beats_after(self, t: float | None) -> int:
        """Heartbeats that came through the new QEMU's agent channel after the switch."""
        if self.dst_agent is None or t is None:
            return 0
        return sum(1 for b in self.dst_agent.heartbeats if b > t)

    def _last_work(self) -> int | None:
        rates = [r for a in (self.src_agent, self.dst_agent) if a for r in a.rates]
        return max((r.work for r in rates), default=None)

    def _answered(self, res: Result) -> None:
        """Did the client's probes get answers after the switch?"""
        if self.prober is None or res.t_running is None:
            return
        replies = self.prober.stats.replies_between(res.t_running + 0.5, time.time())
        self.network["after_switchover"] = {
            "answered_by": "new qemu" if replies else "nobody", "replies": replies}

    def _report(self) -> dict[str, Any]:
        report = self.report()
        res = self.result
        report["mode"] = res.mode if res else None
        report["upgrade"] = {
            **(res.as_dict() if res else {}),
            "from_qemu": str(self.opts.qemu), "to_qemu": str(self.request.to_qemu),
            "counters": self.counters,
            "t_issue": self.t_issue,
        }
        report["pause_breakdown"] = {**(res.breakdown if res else {}), **self._windows()}
        cons = report.get("consistency")
        if isinstance(cons, dict) and res is not None and res.mode.startswith("cpr"):
            cons["ram"] = "same memory (handed over, not copied)"
        return report

    def _windows(self) -> dict[str, Any]:
        """When the guest-visible gaps began and ended, in ms after ``migrate``."""
        t = self.t_issue
        if t is None:
            return {}
        out: dict[str, Any] = {}
        beats = [b for a in (self.src_agent, self.dst_agent) if a for b in a.heartbeats]
        window = sorted(b for b in beats if t - 1.0 <= b <= (self.t_end or time.time()))
        gaps = sorted(((b - a, a) for a, b in itertools.pairwise(window)),
                      reverse=True)[:4]
        out["heartbeat_gaps_top"] = [{"ms": round(g * 1e3, 1),
                                      "at_ms_after_migrate": round((a - t) * 1e3, 1)}
                                     for g, a in gaps]
        res = self.result
        stop_ms = res.breakdown.get("stop_ms") if res is not None else None
        if stop_ms is not None:  # the guest-visible pause around QEMU's own
            t_stop = t + stop_ms / 1e3
            before = [b for b in window if b <= t_stop]
            if before:
                out["last_beat_before_stop_ms"] = round((t_stop - before[-1]) * 1e3, 1)
        if res is not None and res.t_running is not None:
            after = [b for b in window if b > res.t_running]
            if after:
                out["first_beat_after_resume_ms"] = round((after[0] - res.t_running) * 1e3, 1)
        if self.prober is not None:
            ng = self.prober.stats.longest_gap(t - 1.0, self.t_end or time.time())
            if ng is not None:
                out["probe_gap_ms_after_migrate"] = [round((ng[1] - t) * 1e3, 1),
                                                     round((ng[1] + ng[0] - t) * 1e3, 1)]
        return out

    def pause(self) -> dict[str, float | None]:
        """Longest heartbeat gap from a second before ``migrate`` to the end of the
        settle time (not beyond: the clean-up stops the guest)."""
        t = self.t_issue or self.t_migrate
        if t is None:
            return {"guest_pause_ms": None, "guest_pause_raw_ms": None, "verify_hold_ms": None}
        end = self.t_end or time.time()
        beats = sorted(b for a in (self.src_agent, self.dst_agent) if a for b in a.heartbeats
                       if t - 1.0 <= b <= end)
        gap = max((b - a for a, b in itertools.pairwise(beats)), default=None)
        ms = None if gap is None else round(gap * 1000.0, 1)
        return {"guest_pause_ms": ms, "guest_pause_raw_ms": ms, "verify_hold_ms": None}
