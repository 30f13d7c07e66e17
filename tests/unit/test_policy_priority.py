"""Which threads of the source QEMU go below its vCPUs, and when: pure rules."""

from __future__ import annotations

import pytest

from livemig.policy import priority

QEMU = "qemu-system-x86"


def test_named_migration_threads_are_lowered_whenever_they_appeared():
    for comm in ("mig/src/main", "mig/src/send_1", "mig/src/rp-thr", "live_migration",
                 "multifdsend_0"):
        assert priority.lowered(7, comm, QEMU, before={7}, vcpus={3})


def test_named_threads_that_are_not_the_migrations_are_kept():
    for comm in ("CPU 0/TCG", "worker", "IO mon_iothread", "call_rcu", "migrator"):
        assert not priority.lowered(9, comm, QEMU, before={1}, vcpus={3})


def test_an_unnamed_qemu_has_its_new_threads_lowered_but_never_a_vcpu():
    assert priority.lowered(9, QEMU, QEMU, before={1, 3}, vcpus={3})  # new since migrate
    assert not priority.lowered(1, QEMU, QEMU, before={1, 3}, vcpus={3})  # was there
    assert not priority.lowered(3, QEMU, QEMU, before={1}, vcpus={3})  # a vCPU


def test_plan_says_why():
    assert priority.plan(0, True)[0] is None
    assert "migration-nice 0" in priority.plan(0, True)[1]
    nice, why = priority.plan(10, False)
    assert nice is None and "not a process on this host" in why
    assert priority.plan(10, True)[0] == 10
    for bad in (-1, 20):
        with pytest.raises(ValueError):
            priority.plan(bad, True)
