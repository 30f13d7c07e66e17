"""A second look at the guest's pages once the first pass is over.

The deferred choice (:mod:`livemig.engine.switch`) samples the guest while the first
pass begins. A guest that wrote whole pages then, or nothing, gets a whole-page codec
and no delta cache, and if it starts rewriting small parts of its pages later (a
batch job, a cache filling, a database's busy hour while the host is emptied) its
re-sent pages go whole until only a deep throttle lets the rounds converge: set A of
docs/results/late-busy-2026-12-01 was held at 97-99 % for 5-7 s.

:func:`look_again` samples once more when the first pass is over (the source's second
dirty-bitmap sync: every page went once, the rounds of re-sent pages begin), through
the same sampler, and when the guest now rewrites small parts of its pages
(:func:`livemig.policy.encoding.delta_fallback` says so): if the sample's own choice
is now a delta encoding, the stream goes to lz4 with a new delta cache (patch 0019) at
once; else the converge throttle's fallback is armed with one: the first time the
rounds would need a throttle, the stream goes to lz4 deltas instead. Either way the
converge throttle measures the rounds in deltas before any throttle. A guest still
writing whole pages keeps its codec and its throttle, at the cost of one more sample
(the patched QEMU's, ~0.5 s beside the migration, most of it waiting between its two
looks). It looks only where nothing was armed by the first choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from livemig.engine.adapt import Deferred
from livemig.engine.endpoint import QmpEnd
from livemig.engine.events import EventStream
from livemig.engine.executor import PolicyExecutor
from livemig.engine.switch import DELTA_METHOD, start_cache, switch, switch_outcome
from livemig.errors import LivemigError
from livemig.policy import encoding
from livemig.policy.base import SetCompression

POLL_S = 0.25  # how often the first pass's end is looked for
RUNNING = frozenset({"setup", "active"})


def wanted(rec: Mapping[str, Any], first: Mapping[str, Any],
           executor: PolicyExecutor | None) -> int:
    """The new delta cache's size a second look may arm, 0 when none is wanted: the
    first choice switched to a whole-page codec of a stream that started with a delta
    cache, armed no fallback, and the converge throttle runs."""
    if executor is None or executor.converge is None or not rec.get("switched"):
        return 0
    if "delta_fallback" in rec or rec.get("encoding") not in encoding.WHOLE_PAGE:
        return 0
    return start_cache(first.get("applied", {}))


async def look_again(src: QmpEnd, deferred: Deferred, switched: asyncio.Future[dict[str, Any]],
                     first: Mapping[str, Any], executor: PolicyExecutor | None,
                     events: EventStream) -> dict[str, Any] | None:
    """Wait for the switch's choice, then, if :func:`wanted`, for the first pass's end,
    sample again, and if the guest now rewrites small parts of its pages switch to
    lz4 with a new delta cache (the sample chooses deltas) or arm the fallback with
    one. Returns the report's ``encoding.second_look``, or None when it did not look
    (the migration ended first, or nothing to look for)."""
    try:
        rec = await asyncio.shield(switched)
    except (LivemigError, asyncio.CancelledError):
        return None
    cache = wanted(rec, first, executor)
    if not cache:
        return None
    assert executor is not None and executor.converge is not None  # wanted() checked
    t0 = time.monotonic()
    try:
        while True:
            info = await src.cmd("query-migrate")
            if info.get("status") not in RUNNING:
                return None
            if int(info.get("ram", {}).get("dirty-sync-count", 0)) >= 2:
                break
            await asyncio.sleep(POLL_S)
        again, _ = await deferred(EventStream())  # its own events: not the run's choice
    except LivemigError as e:
        out: dict[str, Any] = {"error": str(e)}
        events.event("second look failed", error=str(e))
        return out
    samples = int(again.get("samples") or 0)
    seen = again.get("changed_share")
    share = None if seen is None else float(seen)
    small = samples > 0 and encoding.delta_fallback(
        str(rec.get("encoding")), samples, share) == encoding.KEEP_CACHE
    out = {"samples": samples, "changed_share": share, "after_s": round(
        time.monotonic() - t0, 3), "would_choose": again.get("encoding"), "armed": small}
    if small and share is not None:
        why = (f"a second look after the first pass saw {samples} rewritten "
               f"page{'s' if samples != 1 else ''}, a median {share:.0%} of each changed")
        chosen = str(again.get("encoding"))
        if uses_deltas(chosen):
            out["armed"] = False
            events.event("second look", **out)
            executor.converge.deltas_started(new_cache=True)
            if await executor.apply(SetCompression(
                    f"{why}, and its choice is {chosen}: multifd-compression -> "
                    f"{DELTA_METHOD} with a new {cache >> 20} MiB delta cache now",
                    DELTA_METHOD, cache)):
                out["switched_to"] = f"{DELTA_METHOD} with a new {cache >> 20} MiB delta cache"
            else:
                out["not_switched"] = "QEMU refused a new delta cache (it lacks patch 0019)"
            return out
        executor.converge.arm_delta_fallback(DELTA_METHOD, why, cache)
        out["delta_fallback"] = (f"{why}: if the rounds would need a throttle, the re-sent "
                                 f"pages go as lz4 deltas against a new {cache >> 20} MiB "
                                 "cache first")
    events.event("second look", **out)
    return out


def uses_deltas(choice: str) -> bool:
    """Whether an encoding (or a level of one) sends re-sent pages as lz4 deltas."""
    base = encoding.LEVELS.get(choice, (choice, {}))[0]
    return encoding.DELTA_KEY in encoding.ENCODINGS.get(base, {})


@dataclass
class Beside:
    """The deferred choice's switch and its second look, running beside the migration
    (the engine's loop and the libvirt run's)."""

    switch: asyncio.Task[dict[str, Any]]
    second: asyncio.Task[dict[str, Any] | None]

    @classmethod
    def start(cls, src: QmpEnd, deferred: Deferred, first: Mapping[str, Any],
              params: Mapping[str, Any], events: EventStream,
              executor: PolicyExecutor | None) -> Beside:
        task = asyncio.ensure_future(switch(src, deferred, first, params, events, executor))
        return cls(task, asyncio.ensure_future(
            look_again(src, deferred, task, first, executor, events)))

    async def outcome(self, enc: dict[str, Any] | None, events: EventStream
                      ) -> dict[str, Any]:
        """The report's ``encoding`` once the migration ended (the switch's, with its
        ``second_look`` when one was taken); what still runs is stopped."""
        second = None
        if self.second.done():
            if not self.second.cancelled() and self.second.exception() is None:
                second = self.second.result()
        else:
            self.second.cancel()
            await asyncio.wait({self.second})
        rec = await switch_outcome(self.switch, enc, events)
        return {**rec, "second_look": second} if second is not None else rec
