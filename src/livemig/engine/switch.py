"""The stream's codec, chosen while the migration runs.

With ``x-multifd-compression-switch`` on both ends (qemu/patches/0012, 0013) the
migration starts with zstd keeping lz4's delta cache
(:func:`~livemig.policy.encoding.start_choice`) and the page sample runs beside the
first pass (:attr:`~livemig.engine.adapt.Adapted.deferred`); :func:`switch` then sets
the chosen codec on the source, whose channels take it at their next packet: lz4-delta
finds every page sent so far in the cache, zstd+delta keeps zstd and the cache until
the first pass is over (the executor's ``AfterFirstPass`` then sets lz4), any other
choice drops it. A whole-page choice arms the converge throttle's fallback
(:func:`~livemig.policy.encoding.delta_fallback`): the first time it would throttle,
it switches to lz4 deltas instead. When the sample saw small rewrites, too few for
deltas to pay yet, the switch keeps the cache for it (deltas from the fallback's
first round); when it saw no rewrite, the cache is dropped and the fallback makes a
new one of the start's size (patch 0019 lets QEMU make a dropped cache again; a
build without it refuses, and the throttle goes on as without the fallback). QEMU
refuses resizing a kept cache, which this never asks.

Only the multifd codec settings change mid-stream (:data:`SWITCHED`); a choice that
needs anything else (xbzrle, another channel count) is not applied and the report says
so: the stream keeps the start encoding.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from livemig.engine.adapt import START_EXTRA, Deferred
from livemig.engine.endpoint import QmpEnd
from livemig.engine.events import EventStream
from livemig.engine.executor import PolicyExecutor
from livemig.errors import LivemigError
from livemig.policy import encoding
from livemig.settings import resolve
from livemig.units import parse_size

# the codec and what the start sets beside it (adapt.START_EXTRA): all parameters
SWITCHED = frozenset({"multifd-compression", *START_EXTRA})
# the codec the converge throttle's fallback switches to: lz4, deltas with the cache
DELTA_METHOD = "lz4"


def changes(start: Mapping[str, str], chosen: Mapping[str, str]
            ) -> tuple[dict[str, str], list[str]]:
    """What to set to go from ``start`` to ``chosen``, and the settings that differ but
    cannot change while the migration runs."""
    change = {k: v for k, v in chosen.items() if start.get(k) != v}
    fixed = sorted(k for k in change if k not in SWITCHED)
    return ({k: v for k, v in change.items() if k in SWITCHED}, fixed)


async def switch(src: QmpEnd, deferred: Deferred, first: Mapping[str, Any],
                 params: Mapping[str, Any], events: EventStream,
                 executor: PolicyExecutor | None = None) -> dict[str, Any]:
    """Take the sample, choose, and switch the running stream to the choice; ``first``
    is the report's ``encoding`` of the start (adapt's: ``started_with``, ``applied``),
    ``params`` the source's migration parameters as read before (their types).
    A choice that switches again once the first pass is over (zstd+delta) hands that
    to ``executor``. Returns the report's ``encoding``: the choice, plus
    ``started_with``, ``switched``, ``after_s`` and, when not switched,
    ``kept_because``."""
    t0 = time.monotonic()
    rec, chosen = await deferred(events)
    started = str(first.get("started_with"))
    start: Mapping[str, str] = first.get("applied", {})
    rec = {**rec, "started_with": started}
    change, fixed = changes(start, {**START_EXTRA, **chosen})
    fallback = _delta_fallback(start, change, rec, executor)
    if fallback is not None and not fallback[1]:
        del change[encoding.DELTA_KEY]  # kept for the fallback
    why = None
    if fixed:
        why = f"{', '.join(fixed)} cannot change while the migration runs"
    elif change:
        try:
            await src.cmd("migrate-set-parameters",
                          **resolve(change, {}, params).parameters)
        except LivemigError as e:
            why = f"QEMU refused the switch: {e}"
    rec["after_s"] = round(time.monotonic() - t0, 3)
    if why is not None:
        rec.update(switched=False, kept_because=why)
        events.event("encoding not switched", encoding=rec["encoding"], reason=why)
        events.say(f"stream encoding stays {started}: {why}")
        return rec
    rec["switched"] = bool(change)
    if executor is not None:
        executor.after_first_pass(rec)
        if fallback is not None and executor.converge is not None:
            reason, cache = fallback
            executor.converge.arm_delta_fallback(DELTA_METHOD, reason, cache)
            against = f"a new {cache >> 20} MiB cache" if cache else "the kept cache"
            rec["delta_fallback"] = (f"{reason}: if the rounds would need a throttle, "
                                     f"the re-sent pages go as lz4 deltas against "
                                     f"{against} first")
            rec["delta_cache_kept"] = not cache
            events.event("delta fallback armed", encoding=rec["encoding"], reason=reason,
                         kept=not cache)
    events.event("encoding switched" if change else "encoding kept",
                 encoding=rec["encoding"], settings=change, after_s=rec["after_s"])
    events.say(f"stream encoding {rec['encoding']} from here on"
               if change else f"stream encoding stays {started}")
    return rec


def start_cache(start: Mapping[str, Any]) -> int:
    """The delta cache the stream started with (the start's applied settings), bytes;
    0: none."""
    size = str(start.get(encoding.DELTA_KEY, "0"))
    return parse_size(size) if size != "0" else 0


def _delta_fallback(start: Mapping[str, str], change: Mapping[str, str],
                    rec: Mapping[str, Any], executor: PolicyExecutor | None
                    ) -> tuple[str, int] | None:
    """Why the converge throttle's fallback is armed, and the size of the new cache it
    makes (the start's), 0 when the switch keeps the start's cache; None: no fallback
    (:func:`livemig.policy.encoding.delta_fallback`)."""
    if executor is None or executor.converge is None:
        return None
    if not start_cache(start) or change.get(encoding.DELTA_KEY) != "0":
        return None
    samples = int(rec.get("samples") or 0)
    seen = rec.get("changed_share")
    share = None if seen is None else float(seen)
    how = encoding.delta_fallback(str(rec.get("encoding")), samples, share)
    if how == encoding.KEEP_CACHE and share is not None:
        return (f"the sample saw {samples} rewritten page{'s' if samples != 1 else ''}, a "
                f"median {share:.0%} of each changed: a small writer that may write more",
                0)
    if how == encoding.NEW_CACHE:
        return ("the sample saw no rewrite: what the guest writes if it turns busy is "
                "unknown", start_cache(start))
    return None


async def switch_outcome(task: asyncio.Task[dict[str, Any]], encoding: dict[str, Any] | None,
                         events: EventStream) -> dict[str, Any]:
    """The report's ``encoding`` once the migration ended: the switch's, or the start's
    with why it was kept. A sample still running then is stopped (it is moot)."""
    ended = not task.done()
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is None:
        return task.result()
    why = ("the migration ended before the sample" if ended or task.cancelled()
           else f"the sample failed: {task.exception()}")
    events.event("encoding not switched", reason=why)
    return {**(encoding or {}), "switched": False, "kept_because": why}
