"""The vCPUs' share of the CPU they ask for: the arithmetic on scripted counters, and
the local reader on real threads of this process (the kernel's schedstat)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

from livemig.engine.observe import Observation
from livemig.engine.vcpushare import VcpuShare, libvirt_counters, schedstat_reader


def scripted(values: list[tuple[int, int] | None]):
    it = iter(values)
    return lambda: next(it)


def test_the_share_is_run_over_run_plus_wait_between_polls():
    m = VcpuShare(scripted([(0, 0), (74_000_000, 26_000_000), (174_000_000, 26_000_000)]))
    assert m.poll() == 0.74
    assert m.poll() == 1.0


def test_no_share_from_a_lost_reader_or_counters_that_went_back():
    m = VcpuShare(scripted([(0, 0), None, (5, 5), (50_000_005, 5), (10_000_000, 0)]))
    assert m.poll() is None  # the QEMU went away
    assert m.poll() is None  # no previous reading
    assert m.poll() == 1.0
    assert m.poll() is None  # went back (a new process)


def test_an_idle_guests_polls_add_up_until_enough_was_asked():
    """2 ms asked per poll: nothing said until 5 ms are in, then the share of all
    three polls; a coarse reader (libvirt's ticks) waits for more."""
    ms = 1_000_000
    m = VcpuShare(scripted([(0, 0), (1 * ms, 1 * ms), (2 * ms, 2 * ms), (4 * ms, 2 * ms)]))
    assert m.poll() is None
    assert m.poll() is None
    assert m.poll() == 4 / 6
    coarse = VcpuShare(scripted([(0, 0), (50 * ms, 0), (80 * ms, 30 * ms)]), 0.1)
    assert coarse.poll() is None  # 50 ms: five ticks
    assert coarse.poll() == 80 / 110


def test_libvirt_counters_need_the_delay():
    stats = {"vcpu.current": 2, "vcpu.0.time": 30, "vcpu.0.delay": 10,
             "vcpu.1.time": 50, "vcpu.1.delay": 10}
    assert libvirt_counters(stats) == (80, 20)
    del stats["vcpu.1.delay"]
    assert libvirt_counters(stats) is None
    assert libvirt_counters({"vcpu.current": 0}) is None


def test_the_kernel_counts_a_busy_thread_beside_as_many_busy_threads_as_cpus():
    """Busy threads on every CPU and one more: the measured thread waits in the run
    queue for part of the time (share < 1); a thread that sleeps asks for nothing."""
    stop = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        while not stop.is_set():
            pass

    def nap() -> None:
        tids.append(threading.get_native_id())
        stop.wait()

    cpus = len(os.sched_getaffinity(0))
    threads = [threading.Thread(target=spin) for _ in range(cpus + 1)]
    threads.append(threading.Thread(target=nap))
    for t in threads:
        t.start()
    try:
        while len(tids) < len(threads):
            time.sleep(0.01)
        busy = VcpuShare(schedstat_reader(os.getpid(), tids[:1]))
        napping = VcpuShare(schedstat_reader(os.getpid(), [tids[-1]]))
        time.sleep(0.5)
        share = busy.poll()
        assert share is not None and 0.0 < share < 1.0, share
        assert napping.poll() is None
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_reader_of_a_thread_that_is_gone_reads_nothing():
    assert schedstat_reader(os.getpid(), [2**22 + 7])() is None


def test_the_timeline_and_the_snapshot_carry_the_share():
    obs = Observation.parse(1.0, {"status": "active", "ram": {"remaining": 1}})
    assert "vcpu_share" not in obs.sample() and obs.snapshot().vcpu_share == 0.0
    obs = replace(obs, vcpu_share=0.7412)
    assert obs.sample()["vcpu_share"] == 0.741 and obs.snapshot().vcpu_share == 0.7412
