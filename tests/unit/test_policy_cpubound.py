"""The first pass's CPU check (policy/cpubound.py), fed with polls as set j's
whole-page writer showed them (no VM)."""

from __future__ import annotations

from typing import Any

from livemig.policy.base import SetCompression, Snapshot
from livemig.policy.cpubound import POLLS, CpuBoundCodec
from livemig.policy.encoding import Codec

M = 2**20
LINK = 12.5e6  # 100 Mbit/s, the stream alone on it
# set j's whole-page writer's sample (ratio, bytes per CPU-second)
CODECS = {"zstd": Codec(2.11, 205e6), "zstd-3": Codec(2.21, 145e6),
          "lz4": Codec(1.75, 410e6)}


def polls(wire: float, drain: float, n: int = POLLS, rounds: int = 1) -> list[Snapshot]:
    return [Snapshot(t=0.25 * i, rounds=rounds, remaining=100 * M, dirty_rate=0.0,
                     bandwidth=wire, page_rate=drain) for i in range(n)]


def run(p: CpuBoundCodec, snaps: list[Snapshot]) -> list[Any]:
    out: list[Any] = []
    for s in snaps:
        out += p.decide(s)
    return out


def test_a_starved_zstd_stream_switches_to_lz4_once() -> None:
    # 6.4 MB/s on the wire, 14.1 MB/s of pages: zstd-3 at 145 MB/s per CPU had about
    # 0.1 CPU of the 1 planned; lz4 at that CPU fills the link (21.9 MB/s of pages)
    p = CpuBoundCodec("zstd-3", "zstd", CODECS, LINK, cpus=1.0)
    acts = run(p, polls(6.4e6, 14.1e6))
    assert [type(a) for a in acts] == [SetCompression] and acts[0].method == "lz4"
    assert "0.10 CPU of the 1.00 planned" in acts[0].reason
    assert run(p, polls(6.4e6, 14.1e6)) == []  # once


def test_it_waits_for_enough_polls_and_looks_at_the_first_pass_only() -> None:
    p = CpuBoundCodec("zstd-3", "zstd", CODECS, LINK, cpus=1.0)
    assert run(p, polls(6.4e6, 14.1e6, n=POLLS - 1)) == []
    q = CpuBoundCodec("zstd-3", "zstd", CODECS, LINK, cpus=1.0)
    assert run(q, polls(6.4e6, 14.1e6, rounds=2)) == []  # the re-sends: the plan's


def test_a_stream_that_fills_its_link_or_has_its_cpu_stays() -> None:
    # link-bound: 11 of 12.5 MB/s on the wire
    assert run(CpuBoundCodec("zstd-3", "zstd", CODECS, LINK, 1.0),
               polls(11e6, 24e6)) == []
    # slow on the wire, yet the threads got most of the CPU the choice planned (0.75
    # of a CPU for a slow codec on pages that hardly compress): not starved
    slow = {**CODECS, "zstd-3": Codec(1.05, 20e6), "lz4": Codec(1.0, 60e6)}
    assert run(CpuBoundCodec("zstd-3", "zstd", slow, 25e6, 1.0), polls(14.3e6, 15e6)) == []
    # lz4 would not gain GAIN at the CPU the stream gets (a link far wider than the
    # wire rate and lz4 barely faster)
    close = {**CODECS, "lz4": Codec(1.75, 160e6)}
    assert run(CpuBoundCodec("zstd-3", "zstd", close, 100e6, 1.0), polls(6.4e6, 14.1e6)) == []


def test_nothing_without_the_sample_or_already_in_lz4() -> None:
    assert run(CpuBoundCodec("zstd-3", "zstd", {}, LINK, 1.0), polls(6.4e6, 14.1e6)) == []
    assert run(CpuBoundCodec("lz4", "lz4", CODECS, LINK, 1.0), polls(6.4e6, 14.1e6)) == []


def test_the_executor_watches_a_zstd_first_pass_on_a_switching_qemu() -> None:
    from livemig.engine.executor import PolicyConfig, PolicyExecutor

    enc = {"applied": {"multifd-compression": "zstd", "multifd-zstd-level": "3"},
           "context": {"link_rate": LINK, "cpus": 1.0, "switch": True, "tls": True},
           "first_codecs": {n: [c.ratio, c.speed] for n, c in CODECS.items()}}
    ex = PolicyExecutor(PolicyConfig(), actuator=None,  # type: ignore[arg-type]
                        record=lambda what, data: None)
    ex.after_first_pass(enc)
    (p,) = [p for p in ex.policies if isinstance(p, CpuBoundCodec)]
    assert p.codec == "zstd-3" and p.link == LINK and p.tls
    ex.after_first_pass(enc)  # the deferred choice again: still one
    assert sum(isinstance(p, CpuBoundCodec) for p in ex.policies) == 1
    for no in ({"switch": False}, {"link_rate": None}):
        other = PolicyExecutor(PolicyConfig(), None, lambda w, d: None)  # type: ignore[arg-type]
        other.after_first_pass({**enc, "context": {**enc["context"], **no}})
        assert not any(isinstance(p, CpuBoundCodec) for p in other.policies)
