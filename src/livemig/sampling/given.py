"""A page sample taken before, handed to a later migration instead of a new one.

``livemig evacuate`` samples every domain's pages while it measures the fleet, then
starts one ``livemig migrate --domain`` child per VM. Sampling again in each child
cost 0.8-2.0 s per migration on the 2-core testbed (five children sampling at once,
docs/results/evacuate-2026-11-25.md), on the critical path of every VM, for figures
the evacuation had taken seconds earlier. The evacuation writes each domain's sample
to a file (:func:`dump`) and names it in the child's environment (``ENV``); the
child's encoding choice (:func:`livemig.virt.sampling.adapt_domain`) uses it through
:class:`GivenSampler` when it is this domain's and fresh (:func:`load`), and samples
the guest itself otherwise, saying why.

Only what the sampler measured crosses: the page counts and codec figures
(:class:`~livemig.policy.encoding.Sample`). The child still weighs them against its
own context (its link share, its CPUs, its QEMU's codecs).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from livemig.policy.encoding import Codec, Sample
from livemig.sampling.base import DEFAULT_INTERVAL, DEFAULT_PAGES, SampleResult

ENV = "LIVEMIG_PAGE_SAMPLE"  # the file a ``livemig migrate --domain`` child reuses
# a sample older than this is taken again: a guest's working set and what its pages
# hold can move within minutes (a job starts, a cache fills); a fresh sample costs
# ~1 s, a wrong encoding for the whole migration costs more. An evacuation starts its
# first wave seconds after measuring; VMs queued behind busy ones sample afresh.
MAX_AGE_S = 60.0
FORMAT = 1
CODEC_PARTS = ("first", "resend", "delta")  # the Sample's codec measurements


def dump(path: Path, domain: str, result: SampleResult, taken_at: float) -> None:
    """Write ``result`` (taken at ``taken_at``, seconds since the epoch) for ``domain``."""
    s = result.sample
    doc = {"format": FORMAT, "domain": domain, "taken_at": taken_at,
           "sampler": result.sampler, "wall_s": result.wall_s,
           "sample": {**{f.name: getattr(s, f.name) for f in fields(s)
                         if f.name not in CODEC_PARTS},
                      **{part: {n: asdict(c) for n, c in getattr(s, part).items()}
                         for part in CODEC_PARTS}}}
    path.write_text(json.dumps(doc))


def load(path: Path, domain: str, now: float | None = None) -> tuple[SampleResult | None, str]:
    """The sample in ``path`` if it is ``domain``'s and at most ``MAX_AGE_S`` old;
    else None and why (one line)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            return None, f"{path}: format {doc.get('format')!r}, not {FORMAT}"
        if doc.get("domain") != domain:
            return None, f"{path} is {doc.get('domain')!r}'s sample, not {domain!r}'s"
        age = (time.time() if now is None else now) - float(doc["taken_at"])
        if not (math.isfinite(age) and -1.0 <= age <= MAX_AGE_S):
            return None, f"{path}: taken {age:.0f} s ago (at most {MAX_AGE_S:g} s is reused)"
        return SampleResult(_sample(doc["sample"]), str(doc["sampler"]),
                            float(doc["wall_s"]),
                            {"given": str(path), "age_s": round(age, 3)}), ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path}: not a usable sample ({type(e).__name__}: {e})"


def _sample(d: dict[str, Any]) -> Sample:
    def codecs(part: str) -> dict[str, Codec]:
        return {str(n): Codec(float(c["ratio"]), float(c["speed"]))
                for n, c in (d.get(part) or {}).items()}
    return Sample(looked=int(d["looked"]), nonzero=int(d["nonzero"]), kept=int(d["kept"]),
                  rewritten=int(d["rewritten"]), interval=float(d["interval"]),
                  changed_share=_opt(d.get("changed_share")),
                  zlib_ratio=_opt(d.get("zlib_ratio")),
                  first=codecs("first"), resend=codecs("resend"), delta=codecs("delta"),
                  mid_rewritten=(None if d.get("mid_rewritten") is None
                                 else int(d["mid_rewritten"])),
                  mid_interval=_opt(d.get("mid_interval")),
                  short_rate=_opt(d.get("short_rate")),
                  short_interval=_opt(d.get("short_interval")))


def _opt(x: Any) -> float | None:
    return None if x is None else float(x)


class GivenSampler:
    """A sampler that hands back a sample taken before (no look at the guest)."""

    def __init__(self, result: SampleResult) -> None:
        self.waiting = asyncio.Event()
        self.waiting.set()  # nothing to read
        self.result = result
        self.name = f"given ({result.sampler})"

    async def sample(self, pages: int = DEFAULT_PAGES,
                     interval: float = DEFAULT_INTERVAL) -> SampleResult:
        return self.result
