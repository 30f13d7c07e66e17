"""The sampler interface and what a sample run reports."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from livemig.policy.encoding import Sample

PAGE = 4096
DEFAULT_PAGES = 4096  # non-zero pages looked at twice (the lab's sample size)
DEFAULT_INTERVAL = 0.5  # seconds between the two looks


@dataclass(frozen=True)
class SampleResult:
    """A sample and how it was taken (for the report's ``encoding.sampler``)."""

    sample: Sample
    sampler: str  # qemu | pmemsave | xp | libvirt-peek | file
    wall_s: float  # wall time of the whole sample (both looks and the interval)
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        s = self.sample
        return {"name": self.sampler, "wall_s": round(self.wall_s, 3), "looked": s.looked,
                "nonzero": s.nonzero, "kept": s.kept, "rewritten": s.rewritten,
                "interval_s": round(s.interval, 3),
                **({"mid_rewritten": s.mid_rewritten,
                    "mid_interval_s": round(s.mid_interval, 3)}
                   if s.mid_rewritten is not None and s.mid_interval is not None else {}),
                **({"short_rate_mib_s": round(s.short_rate / 2**20, 1),
                    "short_interval_s": s.short_interval}
                   if s.short_rate is not None else {}),
                **self.detail}


class Sampler(Protocol):
    """Two looks at the same random pages of the guest, ``interval`` seconds apart.
    ``waiting`` is set while the sampler waits for its next look and leaves QEMU's
    monitor free (the caller's own queries go there, not between the reads)."""

    name: str
    waiting: asyncio.Event

    async def sample(self, pages: int = DEFAULT_PAGES,
                     interval: float = DEFAULT_INTERVAL) -> SampleResult: ...
