"""The patched QEMU's own sampler (qemu/patches/0008): ``x-calc-ram-sample`` starts a
thread that looks at random pages of the migratable RAM blocks twice, measures every
codec QEMU has on them, and ``x-query-ram-sample`` returns the numbers. The BQL is
held only to start the thread and to answer the query; no page content crosses QMP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from livemig.errors import VMError
from livemig.policy.encoding import Codec, Sample, codec_from_counts
from livemig.sampling.base import DEFAULT_PAGES, SampleResult

START = "x-calc-ram-sample"
QUERY = "x-query-ram-sample"
POLL_S = 0.05
# Between QEMU's two looks (its thread copies every page of a look within a few tens of
# ms, so each page's gap is this): the recorded samples choose the same encoding with
# gaps of 0.41-0.52 s as with 0.7 s (tests/unit/test_encoding_recorded.py), and the
# user waits for it before the migration starts.
QEMU_INTERVAL = 0.45
SLACK_S = 30.0  # the thread compresses a few MiB per codec: seconds at most

Command = Callable[..., Awaitable[Any]]


def _codecs(part: dict[str, Any] | None) -> dict[str, Codec]:
    out: dict[str, Codec] = {}
    for c in (part or {}).get("codecs", []):
        if int(c.get("bytes-in", 0)) > 0:
            out[str(c["codec"])] = codec_from_counts(
                int(c["bytes-in"]), int(c["bytes-out"]), int(c["cpu-ns"]) / 1e9)
    return out


def parse(reply: dict[str, Any]) -> Sample:
    """``x-query-ram-sample``'s reply as the model's :class:`Sample`."""
    return Sample(
        looked=int(reply["looked"]), nonzero=int(reply["nonzero"]),
        kept=int(reply["kept"]), rewritten=int(reply["rewritten"]),
        interval=int(reply["interval-ms"]) / 1000.0,
        changed_share=reply.get("changed-share"), zlib_ratio=reply.get("zlib-ratio"),
        first=_codecs(reply.get("first")), resend=_codecs(reply.get("resend")),
        delta=_codecs(reply.get("delta")))


class QemuSampler:
    name = "qemu"

    def __init__(self, cmd: Command, seed: int | None = None) -> None:
        self.cmd = cmd
        self.seed = seed
        self.waiting = asyncio.Event()  # QEMU's thread samples: the monitor is free

    async def sample(self, pages: int = DEFAULT_PAGES,
                     interval: float = QEMU_INTERVAL) -> SampleResult:
        t0 = time.monotonic()
        args: dict[str, Any] = {"pages": pages, "interval-ms": round(interval * 1000)}
        if self.seed is not None:
            args["seed"] = self.seed
        await self.cmd(START, **args)
        self.waiting.set()
        deadline = t0 + interval + SLACK_S
        while True:
            await asyncio.sleep(POLL_S)
            reply = await self.cmd(QUERY)
            status = reply.get("status")
            if status == "done":
                break
            if status == "failed":
                raise VMError(f"{QUERY}: {reply.get('error', 'the sample failed')}")
            if time.monotonic() > deadline:
                raise VMError(f"{QUERY}: no sample within {interval + SLACK_S:.0f}s")
        detail = {k: reply[k] for k in ("ram-bytes", "blocks", "look-ns", "cpu-ns")
                  if k in reply}
        return SampleResult(parse(reply), self.name, time.monotonic() - t0,
                            {"qemu": detail})
