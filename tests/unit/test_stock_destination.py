"""A destination known to run a stock QEMU: the doctor's probe says so before an
evacuation, an evacuation learns it from the first child that had to retry toward
it, and the children started after that are told (no refused first attempt each).
No VM, no libvirt."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from livemig.cli import _build_parser
from livemig.doctor.facts import HostFacts, QemuFacts
from livemig.doctor.gate import stock
from livemig.evacuate import run
from livemig.evacuate.schedule import SHARED_LINK, VmFacts
from livemig.sampling import given
from livemig.virt import cli as virt_cli
from livemig.virt import sampling as virt_sampling
from livemig.virt.plan import (
    MIGRATIONS_AT_ONCE_ENV,
    PEER_CAPS,
    PEER_PARAMS,
    STOCK_FOUND_ENV,
    STOCK_PEER_ENV,
    QemuInfo,
    lacks_peer_mechanisms,
)

M = 2**20
DST = "qemu+tcp://d/system"
PATCHED = QemuFacts(
    "/opt/livemig/qemu/bin/qemu-system-x86_64", version="10.2.2",
    capabilities=frozenset({"x-ram-digest-check", "x-switchover-drain",
                            "x-multifd-compression-switch", "multifd"}),
    parameters=frozenset({"multifd-lz4-acceleration", "x-multifd-lz4-delta-cache-size",
                          "max-bandwidth"}))
STOCK = QemuFacts("/usr/bin/qemu-system-x86_64", version="10.2.2",
                  capabilities=frozenset({"multifd"}), parameters=frozenset({"max-bandwidth"}))
GOOD = HostFacts(uri=DST, emulator=PATCHED.path, local=True, qemu=PATCHED)


def test_the_doctors_probe_tells_a_stock_emulator() -> None:
    assert stock(GOOD) is None  # the patched build has every stream mechanism
    told = stock(replace(GOOD, qemu=STOCK))
    assert told is not None and STOCK.path in told
    for name in PEER_CAPS | PEER_PARAMS:
        assert name in told
    # a partial build lacks one: a patched source must not send it there either
    partial = replace(PATCHED, capabilities=PATCHED.capabilities - {"x-switchover-drain"})
    assert stock(replace(GOOD, qemu=partial)) == \
        f"livemig doctor: {PATCHED.path} has no x-switchover-drain"
    # not probed (a remote host's emulator) or not a QEMU: nothing is known
    assert stock(replace(GOOD, qemu=None)) is None
    assert stock(replace(GOOD, qemu=replace(STOCK, error="not a QEMU"))) is None
    assert stock(HostFacts(uri=DST)) is None


def test_only_a_source_with_the_mechanisms_is_held_back() -> None:
    assert lacks_peer_mechanisms(PATCHED.capabilities, PATCHED.parameters) == []
    full = QemuInfo(frozenset(PEER_CAPS | {"multifd"}), {k: 1 for k in PEER_PARAMS},
                    frozenset())
    assert full.peer_mechanisms and not full.for_stock_peer().peer_mechanisms
    assert not QemuInfo(frozenset({"multifd"}), {"max-bandwidth": 1},
                        frozenset()).peer_mechanisms


def _evac(tmp_path: Path, known: dict[str, str] | None = None) -> run.Evacuation:
    vms = [run.Vm(VmFacts(n, 128 * M, 32 * M, 0.0), DST) for n in ("a", "b")]
    opts = run.Options(src_uri="qemu+tcp://s/system", profile="livemig", out=tmp_path,
                       links={SHARED_LINK: 12 * M}, max_parallel=2, max_time=None,
                       stock=known or {})
    return run.Evacuation(opts, vms, object())


def _started(evac: run.Evacuation, v: run.Vm, monkeypatch: pytest.MonkeyPatch
             ) -> tuple[dict[str, str], list[str]]:
    seen: dict[str, Any] = {}

    def child(cmd: list[str], log: Path, env: dict[str, str],
              unset: list[str]) -> subprocess.Popen[bytes]:
        seen["env"], seen["unset"] = env, unset
        return subprocess.Popen(["true"])
    monkeypatch.setattr(evac.pool, "run", child)
    evac._start(v, 12 * M, "why", 12 * M)
    assert v.proc is not None
    v.proc.wait()
    return seen["env"], seen["unset"]


def test_the_children_after_a_retry_are_told(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STOCK_PEER_ENV, "inherited")  # never passed on as it is
    evac = _evac(tmp_path)
    assert STOCK_PEER_ENV not in evac.pool.env
    a, b = evac.vms
    env, unset = _started(evac, a, monkeypatch)
    assert STOCK_PEER_ENV not in env
    assert {STOCK_PEER_ENV, STOCK_FOUND_ENV, given.ENV} <= set(unset)
    found = Path(env[STOCK_FOUND_ENV])
    evac._learn_stock(a)  # nothing written: nothing learnt
    assert evac.stock == {}
    # a's child found its first attempt refused (it writes that before its retry): the
    # VMs started from now on are told, with how it is known
    found.write_text("x-multifd-compression-switch\n")
    evac._learn_stock(a)
    assert evac.stock[DST] == "a's first attempt: it has no x-multifd-compression-switch"
    env, _ = _started(evac, b, monkeypatch)
    assert env[STOCK_PEER_ENV] == evac.stock[DST] and STOCK_FOUND_ENV not in env
    # learnt once
    Path(str(found).replace("a.try1", "b.try1")).write_text("other")
    evac._learn_stock(b)
    evac._learn_stock(a)
    assert evac.stock[DST].startswith("a's")
    assert [e["event"] for e in evac.events].count("stock destination") == 1


def test_the_doctors_word_reaches_the_first_child(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    evac = _evac(tmp_path, {DST: "livemig doctor: /usr/bin/qemu has no x"})
    env, _ = _started(evac, evac.vms[0], monkeypatch)
    assert env[STOCK_PEER_ENV] == "livemig doctor: /usr/bin/qemu has no x"


def test_the_child_reads_what_it_was_told(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = _build_parser("migrate")
    a = parser.parse_args(["migrate", "--domain", "g", "--connect", "qemu:///system",
                           "--to", DST])
    defaults = vars(parser.parse_args(["migrate"]))
    monkeypatch.delenv(STOCK_PEER_ENV, raising=False)
    monkeypatch.delenv(STOCK_FOUND_ENV, raising=False)
    o = virt_cli.options(a, defaults)
    assert not o.stock_peer and o.stock_told == "" and o.stock_found is None
    monkeypatch.setenv(STOCK_PEER_ENV, "livemig doctor: q has no x")
    monkeypatch.setenv(STOCK_FOUND_ENV, "/run/x.stock")
    o = virt_cli.options(a, defaults)
    assert o.stock_peer and o.stock_told == "livemig doctor: q has no x"
    assert o.stock_found == "/run/x.stock"


class _Conn:
    def getInfo(self) -> list[Any]:
        return ["x86_64", 16384, 8]

    def getFreeMemory(self) -> int:
        return 16 << 30


class _Dom:
    def info(self) -> list[Any]:
        return [1, 1 << 20, 1 << 20, 2, 0]


def test_the_migrations_an_evacuation_runs_at_once_share_the_sources_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each child's delta cache is sized from its share of the source's free memory
    (encoding.delta_cache takes at most a quarter of what it is told), so the caches
    of the migrations that run at once stay within what one alone may take."""
    monkeypatch.setenv(MIGRATIONS_AT_ONCE_ENV, "9")  # the user's: never passed on
    evac = _evac(tmp_path)  # max_parallel=2
    assert MIGRATIONS_AT_ONCE_ENV not in evac.pool.env
    env, unset = _started(evac, evac.vms[0], monkeypatch)
    assert env[MIGRATIONS_AT_ONCE_ENV] == "2" and MIGRATIONS_AT_ONCE_ENV in unset
    fixed = replace(evac.o, scheduler="fixed:3")
    evac.o = fixed
    env, _ = _started(evac, evac.vms[1], monkeypatch)
    assert env[MIGRATIONS_AT_ONCE_ENV] == "3"
    # the child reads it once, with its other options; its free memory is its share
    parser = _build_parser("migrate")
    a = parser.parse_args(["migrate", "--domain", "g", "--connect", "qemu:///system",
                           "--to", DST])
    defaults = vars(parser.parse_args(["migrate"]))
    for told, free in (("2", 8 << 30), ("0", 16 << 30), ("x", 16 << 30), (None, 16 << 30)):
        if told is None:
            monkeypatch.delenv(MIGRATIONS_AT_ONCE_ENV)
        else:
            monkeypatch.setenv(MIGRATIONS_AT_ONCE_ENV, told)
        at_once = virt_cli.options(a, defaults).at_once
        assert virt_sampling.host_hints(_Conn(), _Dom(), at_once=at_once).host_available \
            == free
