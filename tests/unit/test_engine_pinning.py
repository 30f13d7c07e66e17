"""The engine's thread pinning on a real process: threads named like QEMU's are
pinned as the plan says, and their affinities are put back afterwards (the restore
the engine runs at the end and the guardian runs if livemig dies)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator

import pytest

from livemig.engine import pinning
from livemig.policy.pinning import PinPlan

HOST = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(HOST) < 2, reason="needs two host CPUs")


def _name_self(name: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/.../comm shows


@pytest.fixture
def qemu_like() -> Iterator[dict[str, int]]:
    """Two threads of this process named like a QEMU's vCPU and migration threads."""
    stop = threading.Event()
    tids: dict[str, int] = {}
    ready = threading.Barrier(3)

    def worker(name: str) -> None:
        _name_self(name)
        tids[name] = threading.get_native_id()
        ready.wait()
        stop.wait()

    ts = [threading.Thread(target=worker, args=(n,)) for n in ("CPU 0/TCG", "mig/src/send_0")]
    for t in ts:
        t.start()
    ready.wait()
    yield tids
    stop.set()
    for t in ts:
        t.join()


def test_pins_vcpu_and_migration_threads_and_restores_the_vcpus(qemu_like):
    plan = PinPlan(frozenset(HOST[:-1]), frozenset(HOST[-1:]), "test")
    p = pinning.ThreadPinner(os.getpid(), plan, "on")
    vcpu, mig = qemu_like["CPU 0/TCG"], qemu_like["mig/src/send_0"]
    assert p.originals == {vcpu: HOST}  # only the vCPU outlives the migration
    p.apply()
    assert sorted(os.sched_getaffinity(vcpu)) == HOST[:-1]
    assert sorted(os.sched_getaffinity(mig)) == HOST[-1:]
    assert sorted(os.sched_getaffinity(0)) == HOST  # other threads untouched
    assert set(p.as_report()["threads"]) == {f"{vcpu}:CPU 0/TCG", f"{mig}:mig/src/send_0"}
    done = p.restore()
    assert sorted(os.sched_getaffinity(vcpu)) == HOST
    assert len(done) == 1 and str(vcpu) in done[0]
    assert p.restore() == []  # nothing left to undo


def test_guardian_restore_from_the_spec(qemu_like):
    vcpu = qemu_like["CPU 0/TCG"]
    spec = {str(t): c for t, c in pinning.vcpu_affinities(os.getpid()).items()}
    os.sched_setaffinity(vcpu, HOST[:1])
    pinning.restore_affinities({int(t): c for t, c in spec.items()})
    assert sorted(os.sched_getaffinity(vcpu)) == HOST


def test_plan_for_says_why_not():
    assert pinning.plan_for(os.getpid(), 1, "off") == (None, "pinning off")
    p, why = pinning.plan_for(None, 1, "on")
    assert p is None and "not on this host" in why
    p, why = pinning.plan_for(os.getpid(), len(HOST), "auto")  # no spare CPU
    assert p is None and "no spare host CPU" in why
    p, _ = pinning.plan_for(os.getpid(), 1, "on")
    assert p is not None and p.plan.migration_cpus


def test_migration_thread_names_of_both_qemu_generations():
    for comm in ("live_migration", "multifdsend_1", "mig/src/main", "mig/src/send_3"):
        assert pinning.is_migration_thread(comm)
    for comm in ("CPU 0/TCG", "qemu-system-x86", "IO mon_iothread", "migrator"):
        assert not pinning.is_migration_thread(comm)


def test_vcpus_named_by_qmp_when_threads_have_no_names(qemu_like):
    """A QEMU without debug-threads=on: the vCPU comes from query-cpus-fast's
    thread-id, whatever its name."""
    other = qemu_like["mig/src/send_0"]  # any thread of ours stands for the vCPU
    plan = PinPlan(frozenset(HOST[:-1]), frozenset(HOST[-1:]), "test")
    p = pinning.ThreadPinner(os.getpid(), plan, "on", vcpu_tids=[other])
    assert p.originals == {other: HOST}
    p.apply()
    assert sorted(os.sched_getaffinity(other)) == HOST[:-1]
    assert sorted(os.sched_getaffinity(qemu_like["CPU 0/TCG"])) == HOST  # not a vCPU now
    p.restore()
    assert sorted(os.sched_getaffinity(other)) == HOST
