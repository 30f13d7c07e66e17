"""A patched source and a stock destination (a host not yet upgraded, or rolled
back): the plan keeps to what both QEMUs have. Before, the livemig profile set the
source's ``x-switchover-drain`` on the destination too, which refused it, and the
migration failed before it started. Scripted QMP ends (pure logic; the real QEMUs
are in tests/vm/test_attach_vm.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fakeqmp import FakeEnd
from livemig.engine.adapt import Hints, context
from livemig.engine.negotiate import negotiate
from livemig.engine.plan import Plan
from livemig.errors import UsageError
from livemig.policy.encoding import DELTA_KEY
from livemig.settings import DRAIN_CAP, merge

URI = "tcp:127.0.0.1:4444"


def _ends(src_patched: bool, dst_patched: bool) -> tuple[FakeEnd, FakeEnd]:
    src, dst = FakeEnd("src"), FakeEnd("dst", status="inmigrate")
    for end, patched in ((src, src_patched), (dst, dst_patched)):
        end.caps["return-path"] = False
        if patched:
            end.caps[DRAIN_CAP] = False
            end.params[DELTA_KEY] = 0
    return src, dst


def _plan(sets: dict[str, str]) -> Plan:
    return Plan(URI, settings=tuple(merge("livemig", sets).items()), profile="livemig",
                explicit=frozenset(sets)).validate()


def test_a_stock_destination_gets_none_of_the_sources_own_mechanisms() -> None:
    src, dst = _ends(src_patched=True, dst_patched=False)
    n = asyncio.run(negotiate(src, dst, _plan({})))
    assert DRAIN_CAP not in n.capabilities and "return-path" not in n.capabilities
    # and the run's events can say what was left out, and why
    # (return-path, which the drain needs, both have: not named)
    assert n.unused == (DRAIN_CAP,)
    # the same pair, both patched: the drain, and nothing unused
    src, dst = _ends(src_patched=True, dst_patched=True)
    n = asyncio.run(negotiate(src, dst, _plan({})))
    assert n.capabilities[DRAIN_CAP] is True and n.unused == ()


def test_a_stock_source_and_a_patched_destination_keep_to_stock() -> None:
    src, dst = _ends(src_patched=False, dst_patched=True)
    n = asyncio.run(negotiate(src, dst, _plan({})))
    assert DRAIN_CAP not in n.capabilities and n.unused == ()


def test_a_setting_only_the_source_has_is_a_usage_error_naming_the_destination() -> None:
    src, dst = _ends(src_patched=True, dst_patched=False)
    with pytest.raises(UsageError, match=f"destination QEMU has no {DELTA_KEY}"):
        asyncio.run(negotiate(src, dst, _plan({DELTA_KEY: "64M"})))
    assert not dst.called("migrate-set-capabilities")  # refused before anything changed


class Source:
    """A patched source's answers to the context's queries: lz4 and the delta cache."""

    pid = None  # not on this host: no link read from its route

    async def cmd(self, command: str, **_args: Any) -> Any:
        return {"query-cpus-fast": [{}],
                "query-memory-size-summary": {"base-memory": 1 << 30},
                "query-migrate-parameters": {DELTA_KEY: 0, "multifd-compression": "none"},
                "query-qmp-schema": _schema(["none", "zlib", "zstd", "lz4"]),
                "query-migrate-capabilities": []}[command]


def _schema(codecs: list[str]) -> list[dict[str, Any]]:
    return [{"name": "query-migrate-parameters", "meta-type": "command", "ret-type": "p"},
            {"name": "p", "members": [{"name": "multifd-compression", "type": "c"}]},
            {"name": "c", "values": codecs}]


def test_the_encoding_is_chosen_among_the_codecs_both_ends_have() -> None:
    plan = Plan(URI)
    ctx = asyncio.run(context(Source(), plan, Hints(), switch=False))  # type: ignore[arg-type]
    assert "lz4" in ctx.codecs and ctx.delta
    stock = Hints(dst_codecs=frozenset({"plain", "zstd"}), dst_delta=False)
    ctx = asyncio.run(context(Source(), plan, stock, switch=False))  # type: ignore[arg-type]
    assert "lz4" not in ctx.codecs and "zstd" in ctx.codecs and not ctx.delta
