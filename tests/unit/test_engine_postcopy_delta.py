"""A migration that may turn to post-copy gets no lz4 delta cache: QEMU refuses
``x-multifd-lz4-delta-cache-size`` beside ``postcopy-ram`` (patch 0005), and under
libvirt the capabilities call failed and the migration with it. A scripted source
QEMU answers the context's queries (pure logic; the real daemons are in
tests/testbed/test_libvirt_vm.py's post-copy test)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from livemig.engine.adapt import Hints, context
from livemig.engine.plan import Plan
from livemig.policy.encoding import DELTA_KEY


class PatchedSource:
    pid = None  # not on this host: no link read from its route

    async def cmd(self, command: str, **_args: Any) -> Any:
        return {"query-cpus-fast": [{}],
                "query-memory-size-summary": {"base-memory": 1 << 30},
                "query-migrate-parameters": {DELTA_KEY: 0, "multifd-compression": "none"},
                "query-qmp-schema": [],
                "query-migrate-capabilities": []}[command]


@pytest.mark.parametrize(("settings", "delta"), [
    ((), True),
    ((("postcopy-after", "2"),), False),
    ((("on-stall", "postcopy"),), False),
    ((("postcopy-ram", "on"),), False),
    ((("postcopy-ram", "off"),), True),
])
def test_the_delta_cache_is_left_out_where_post_copy_may_follow(
        settings: tuple[tuple[str, str], ...], delta: bool) -> None:
    plan = Plan("tcp:127.0.0.1:1", settings=settings)
    assert plan.postcopy is not delta
    ctx = asyncio.run(context(PatchedSource(), plan, Hints(), switch=False))  # type: ignore[arg-type]
    assert ctx.delta is delta
