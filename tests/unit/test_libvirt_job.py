"""libvirt's migration job driven by the engine's own monitor (``virt/job.py``): the
same loop, policies, limits and stall watchdog as lab and attach runs. A scripted
domain stands in for libvirt (pure logic: the real daemons are in
tests/testbed/test_libvirt_vm.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from livemig.engine.decision import CONTINUE, Decision, Verdict
from livemig.engine.events import EventStream
from livemig.engine.monitor import Monitor, Terminal
from livemig.errors import VMError
from livemig.policy.base import Snapshot
from livemig.virt.job import DomainJob

M = 1 << 20


class LibvirtError(Exception):
    pass


class FakeLibvirt:
    libvirtError = LibvirtError
    VIR_DOMAIN_JOB_NONE = 0
    VIR_DOMAIN_PAUSED = 3
    VIR_DOMAIN_RUNNING = 1
    VIR_DOMAIN_PAUSED_POSTCOPY = 12


class Domain:
    """A migration job: ``prepare_s`` of preparing (no figures; an abort then is
    ignored, as libvirt's is while it prepares the destination), then RAM sent at
    ``rate`` bytes/s until ``stall_at`` (if given) or until all is sent."""

    def __init__(self, total: int = 64 * M, rate: float = 64 * M, prepare_s: float = 0.05,
                 stall_at: int | None = None, disk: int = 0) -> None:
        self.total, self.rate, self.prepare_s = total, rate, prepare_s
        self.stall_at, self.disk = stall_at, disk
        self.t0 = time.monotonic()
        self.aborts: list[float] = []
        self.aborted = threading.Event()

    def _sent(self) -> tuple[int, int]:
        """(disk copied, RAM sent) so far."""
        t = time.monotonic() - self.t0 - self.prepare_s
        if t < 0:
            return 0, 0
        moved = int(t * self.rate)
        disk = min(self.disk, moved)
        ram = min(self.total, moved - disk)
        if self.stall_at is not None:
            ram = min(ram, self.stall_at)
        return disk, ram

    def jobStats(self, _flags: int) -> dict[str, Any]:
        if time.monotonic() - self.t0 < self.prepare_s:
            return {"type": 2}
        disk, ram = self._sent()
        # a stream that packs its pages 2:1: twice the bytes on the wire in pages
        return {"type": 2, "memory_total": self.total, "memory_processed": ram,
                "memory_remaining": self.total - ram, "memory_bps": self.rate,
                "memory_iteration": 1, "disk_total": self.disk,
                "disk_remaining": self.disk - disk, "memory_page_size": 4096,
                "memory_normal": 2 * ram // 4096,
                "time_elapsed": int((time.monotonic() - self.t0) * 1000)}

    def abortJob(self) -> None:
        self.aborts.append(time.monotonic() - self.t0)
        if time.monotonic() - self.t0 >= self.prepare_s:
            self.aborted.set()

    def state(self) -> tuple[int, int]:
        return FakeLibvirt.VIR_DOMAIN_RUNNING, 1

    def call(self) -> None:
        """virDomainMigrateToURI3: returns once all is sent, raises once aborted."""
        while True:
            if self.aborted.wait(0.01):
                raise LibvirtError("operation aborted: migration out job: canceled by client")
            if self._sent()[1] >= self.total and self.stall_at is None:
                return


class Policies:
    def __init__(self, cancel_after: int | None = None) -> None:
        self.seen: list[Snapshot] = []
        self.cancel_after = cancel_after

    @property
    def active(self) -> bool:
        return True

    async def tick(self, s: Snapshot) -> Verdict:
        self.seen.append(s)
        if self.cancel_after is not None and len(self.seen) >= self.cancel_after:
            return Verdict(Decision.CANCEL, "the policy gave up")
        return CONTINUE


class Hooks:
    def __init__(self, job: DomainJob) -> None:
        self.job = job

    async def on_poll(self, now: float, obs: Any) -> dict[str, Any]:
        return {}

    def disk_observation(self) -> dict[str, Any] | None:
        s = self.job.stats or {}
        return ({"remaining": s["disk_remaining"], "total": s["disk_total"]}
                if s.get("disk_total") else None)

    async def pre_switchover(self) -> bool:
        return False

    def destination_dead(self) -> None:
        return None


def _run(dom: Domain, policies: Policies | None = None, max_time: float | None = None,
         stall_timeout: float = 0.0) -> tuple[Terminal, DomainJob, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    job = DomainJob(dom, FakeLibvirt, dom.call, lambda: 0,
                    lambda what, **kw: events.append({"event": what, **kw}))
    timeline: list[dict[str, Any]] = []

    async def go() -> Terminal:
        job.start()
        mon = Monitor(job, EventStream(), 0.02, time.time(), max_time, asyncio.Event(),
                      policies, Hooks(job), timeline, stall_timeout=stall_timeout)
        return await mon.run()
    end = asyncio.run(go())
    job.thread.join(5)
    return end, job, timeline


def test_a_job_that_ends_is_completed_and_its_polls_are_the_timeline() -> None:
    end, _, timeline = _run(Domain(total=16 * M, rate=64 * M))
    assert end.status == "completed"
    assert timeline[0]["status"] == "prepare"
    assert any(s["status"] == "active" and s["transferred"] for s in timeline)


def test_max_time_aborts_again_until_libvirt_has_prepared() -> None:
    dom = Domain(total=1 << 40, rate=8 * M, prepare_s=0.3)
    end, _, _ = _run(dom, max_time=0.1)
    assert end.status == "cancelled" and "--max-time" in str(end.cancelled_for)
    # the first abort fell into libvirt's preparation and was ignored: it was repeated
    assert len(dom.aborts) >= 2 and dom.aborts[0] < 0.3 <= dom.aborts[-1]


def test_policies_tick_on_the_disk_copy_and_the_ram_not_while_libvirt_prepares() -> None:
    dom = Domain(total=1 << 40, rate=64 * M, prepare_s=0.1, disk=8 * M)
    pol = Policies(cancel_after=12)
    end, _, timeline = _run(dom, pol)
    assert end.status == "cancelled" and end.cancelled_for == "the policy gave up"
    assert dom.aborts
    assert pol.seen[0].disk_total == 8 * M and pol.seen[0].ram_total == 1 << 40
    assert any(s.disk_remaining == 0 and s.remaining < 1 << 40 for s in pol.seen)
    statuses = [s["status"] for s in timeline]
    assert statuses[0] == "prepare" and "disk" in statuses and "active" in statuses
    assert len(pol.seen) == sum(1 for s in statuses if s in ("disk", "active"))


def test_a_job_whose_bytes_stop_is_cancelled_by_the_stall_watchdog() -> None:
    dom = Domain(total=1 << 40, rate=64 * M, stall_at=4 * M)
    end, _, _ = _run(dom, stall_timeout=0.3)
    assert end.status == "cancelled", end
    assert str(end.cancelled_for).startswith("stalled: no migration bytes moved")
    assert dom.aborts


def test_a_failed_call_is_failed_with_libvirts_message() -> None:
    class Broken(Domain):
        def call(self) -> None:
            raise LibvirtError("internal error: qemu unexpectedly closed the monitor")

    end, _, _ = _run(Broken())
    assert end.status == "failed"
    assert "closed the monitor" in end.info["error-desc"]


class Stuck(Domain):
    """libvirt's call does not return after the abort (its rollback waits on a dead
    link to the destination daemon); the source QEMU's own migration says
    ``qemu_status`` once aborted, and the domain is in ``state``."""

    def __init__(self, qemu_status: str, state: int = FakeLibvirt.VIR_DOMAIN_RUNNING) -> None:
        super().__init__(total=1 << 40, rate=8 * M)
        self.qemu_status, self.run_state = qemu_status, state
        self.release = threading.Event()

    def call(self) -> None:
        self.release.wait(30)
        raise LibvirtError("operation aborted")

    def state(self) -> tuple[int, int]:
        return self.run_state, 1

    def qemu(self) -> dict[str, Any]:
        return {"status": self.qemu_status if self.aborted.is_set() else "active"}

    def yank(self) -> None:
        self.yanks = getattr(self, "yanks", 0) + 1
        if self.qemu_status == "cancelling":
            self.qemu_status = "cancelled"  # the channels shut down: the threads end


def _run_stuck(dom: Stuck, monkeypatch: Any) -> Terminal:
    from livemig.engine import monitor as monitor_mod
    from livemig.virt import job as job_mod

    monkeypatch.setattr(job_mod, "DETACH_AFTER_S", 0.2)
    monkeypatch.setattr(monitor_mod, "CANCEL_TIMEOUT_S", 2.0)
    events: list[dict[str, Any]] = []
    job = DomainJob(dom, FakeLibvirt, dom.call, lambda: 0,
                    lambda what, **kw: events.append({"event": what, **kw}),
                    qemu_migration=dom.qemu, yank=dom.yank)

    async def go() -> Terminal:
        job.start()
        mon = Monitor(job, EventStream(), 0.02, time.time(), 0.2, asyncio.Event(),
                      None, Hooks(job), [])
        return await mon.run()
    try:
        return asyncio.run(go())
    finally:
        dom.release.set()
        job.thread.join(5)


def test_a_cancelled_job_whose_call_hangs_ends_once_qemu_cancelled_and_the_guest_runs(
        monkeypatch: Any) -> None:
    dom = Stuck("cancelled")
    t0 = time.monotonic()
    end = _run_stuck(dom, monkeypatch)
    assert end.status == "cancelled" and "--max-time" in str(end.cancelled_for)
    assert "libvirt's call had not returned" in end.info["error-desc"]
    assert time.monotonic() - t0 < 2.0  # not the monitor's cancel timeout


def test_a_hanging_call_is_not_left_while_qemu_still_migrates_or_the_guest_is_paused(
        monkeypatch: Any) -> None:
    for dom in (Stuck("active"), Stuck("cancelled", FakeLibvirt.VIR_DOMAIN_PAUSED)):
        with pytest.raises(VMError, match="after migrate_cancel"):
            _run_stuck(dom, monkeypatch)


def test_a_source_qemu_stuck_cancelling_is_yanked_once_then_the_job_ends(
        monkeypatch: Any) -> None:
    dom = Stuck("cancelling")
    end = _run_stuck(dom, monkeypatch)
    assert end.status == "cancelled" and dom.yanks == 1
    assert "cancelled; libvirt's call had not returned" in end.info["error-desc"]
    # never yanked where QEMU's migration had ended by itself
    done = Stuck("cancelled")
    _run_stuck(done, monkeypatch)
    assert not hasattr(done, "yanks")


def test_the_end_of_the_first_pass_wakes_the_monitor_between_its_polls() -> None:
    """libvirt's migration-iteration event 2 (QEMU's MIGRATION_PASS: the first pass is
    over) reaches the monitor through the job, which polls and ticks the policies at
    once (zstd+delta's codec switch) instead of at its next period; pass 1 does not
    wake it, and the monitor records no second "round" event (the run has its own).
    The policy cancels at its second tick, so the run ends soon after it."""
    dom = Domain(total=1 << 40, rate=8 * M)
    pol = Policies(cancel_after=2)
    job = DomainJob(dom, FakeLibvirt, dom.call, lambda: 0, lambda what, **kw: None)
    stream = EventStream()

    def rounds() -> None:  # libvirt's event thread
        time.sleep(0.3)
        job.passed(1)
        time.sleep(0.3)
        job.passed(2)

    async def go() -> Terminal:
        job.start()
        threading.Thread(target=rounds, daemon=True).start()
        mon = Monitor(job, stream, 3.0, time.time(), None, asyncio.Event(), pol,
                      Hooks(job), [])
        return await asyncio.wait_for(mon.run(), 20.0)

    t0 = time.monotonic()
    end = asyncio.run(go())
    job.thread.join(5)
    assert end.status == "cancelled" and end.cancelled_for == "the policy gave up"
    # libvirt still preparing at the first poll (no tick); a tick at pass 2 (0.6 s),
    # then the period's own poll (3 s)
    first, second = (s.t for s in pol.seen)
    assert first < 2.5 <= second
    assert time.monotonic() - t0 < 15.0  # the job's waits end with it
    assert not [e for e in stream.log if e.get("event") == "round"]


def test_the_policies_see_the_pages_drained_not_only_the_wire_bytes() -> None:
    """libvirt passes on no ``pages-per-second``; the job derives it from the pages
    libvirt counts (here twice the wire bytes: a 2:1 codec), so the converge
    throttle drains the remainder at the page rate, as in lab and attach runs."""
    dom = Domain(total=64 * M, rate=16 * M, prepare_s=0.0)
    pol = Policies()
    job = DomainJob(dom, FakeLibvirt, dom.call, lambda: 0, lambda what, **kw: None)

    async def go() -> Terminal:
        job.start()
        mon = Monitor(job, EventStream(), 0.1, time.time(), None, asyncio.Event(),
                      pol, Hooks(job), [])
        return await mon.run()
    asyncio.run(go())
    job.thread.join(5)
    rates = [s.page_rate / s.bandwidth for s in pol.seen[1:] if s.bandwidth]
    assert pol.seen and pol.seen[0].page_rate == 0.0  # nothing to compare with yet
    assert rates and all(1.6 < r < 2.4 for r in rates), rates
