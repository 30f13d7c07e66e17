"""The engine's lowering of a QEMU's migration threads, on real threads of this process:
the threads that appear after it was set up and are named like QEMU's migration threads
go to the nice value, the vCPU and the threads there before do not, and what is still
alive at the end gets its nice value back."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Iterator

import pytest

from livemig.engine import priority


def _name_self(name: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc/.../comm shows


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def spawn() -> Iterator[Callable[[str], int]]:
    """Start a thread of this process named ``name``; its thread id."""
    stop = threading.Event()
    started: list[threading.Thread] = []

    def start(name: str) -> int:
        out: list[int] = []
        ready = threading.Event()

        def worker() -> None:
            _name_self(name)
            out.append(threading.get_native_id())
            ready.set()
            stop.wait()

        t = threading.Thread(target=worker)
        t.start()
        started.append(t)
        ready.wait()
        return out[0]

    yield start
    stop.set()
    for t in started:
        t.join()


def test_lowers_the_migration_threads_that_appear_and_nothing_else(spawn):
    vcpu = spawn("CPU 0/TCG")
    older = spawn("IO mon_iothread")  # there before: not this migration's
    p = priority.ThreadPriority(os.getpid(), 10, [vcpu])
    send = spawn("mig/src/send_0")
    worker = spawn("worker")
    base = _nice(vcpu)
    p.apply()
    assert _nice(send) == 10
    assert _nice(vcpu) == base and _nice(worker) == base and _nice(older) == base
    assert p.as_report() == {"nice": 10, "threads": {str(send): "mig/src/send_0"}}
    done = p.restore()
    if priority.may_raise():
        assert _nice(send) == base and len(done) == 1 and str(send) in done[0]
    else:  # without CAP_SYS_NICE a nice value cannot go back down: the thread ends
        assert done == []


def test_a_qemu_that_names_no_threads_has_its_new_non_vcpu_threads_lowered(spawn):
    if not priority.may_raise():
        pytest.skip("unnamed threads are lowered only when they can be put back")
    me = priority._comm(os.getpid())
    vcpu = spawn(me)  # no names: a vCPU only QMP's thread-id tells apart
    p = priority.ThreadPriority(os.getpid(), 5, [vcpu])
    new_vcpu_like = spawn(me)
    p.vcpus = frozenset({vcpu, new_vcpu_like})  # a vCPU hot-plugged since
    new = spawn(me)
    p.apply()
    assert _nice(new) == 5 and _nice(vcpu) == 0 and _nice(new_vcpu_like) == 0
    assert p.restore() and _nice(new) == 0


def test_plan_for_a_qemu_elsewhere_or_off():
    assert priority.plan_for(None, 10, [1])[0] is None
    assert priority.plan_for(os.getpid(), 0, [1])[0] is None
    p, why = priority.plan_for(os.getpid(), 10, [1])
    assert p is not None and "nice 10" in why
