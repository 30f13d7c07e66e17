"""The soak loop on a scripted shuttle (no VM): what it writes, when it stops, its exit."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import ClassVar

import pytest

from livemig.lab.faults import Fault
from livemig.pingpong import Combination, Hop, ShuttleConfig
from livemig.soak import cli, ledger, run
from livemig.spec import parse_workload


class FakeShuttle:
    """Hops that complete and verify unless a script says otherwise."""

    # hop -> "miss" (fault not named), "lost", "abort", "fail"
    script: ClassVar[dict[int, str]] = {}

    def __init__(self, cfg: ShuttleConfig, prefix: str = "v") -> None:
        self.id = prefix + "fake"
        self.interrupted = False
        self.workload = parse_workload(cfg.workload)
        self.boot_text = cfg.workload
        self.running: object | None = None
        self.loads: list[str] = []
        self.host = "src"
        FakeShuttle.last = self  # type: ignore[attr-defined]

    def interrupt(self) -> None:
        self.interrupted = True

    @contextlib.asynccontextmanager
    async def session(self, say: Callable[[str], None]) -> AsyncIterator[FakeShuttle]:
        yield self

    async def set_load(self, text: str) -> None:
        self.workload = parse_workload(text)
        self.loads.append(text)

    async def hop(self, index: int, name: str, c: Combination,
                  fault: Fault | None = None) -> Hop:
        what = self.script.get(index, "")
        dst = "dst" if self.host == "src" else "src"
        h = Hop(index, name, self.host, dst, wall_s=1.0)
        outcome = {"abort": "aborted", "fail": "failed"}.get(what, "completed")
        h.report = {"outcome": outcome, "reason": what or None, "total_time_s": 1.0,
                    "guest_pause_ms": 30.0,
                    "consistency": {"ram": "ok", "disk": "skipped", "guest": "ok"}}
        if what == "abort":
            self.interrupted = True
            return h
        if fault is not None and outcome == "completed":
            h.injected = [{"target": fault.target, "block": "0x1000", "t": 0.0}]
            h.detected_by_host = 1
            h.detected_by_guest = 0 if what == "miss" else 1
        h.guest_lost = what == "lost"
        self.running = None if h.guest_lost else object()
        if outcome == "completed":
            self.host = dst
        return h


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakeShuttle]:
    monkeypatch.setattr(run, "Shuttle", FakeShuttle)
    FakeShuttle.script = {}
    return FakeShuttle


def _opts(path: Path, hops: int | None = 6, names: list[str] | None = None,
          every: int | None = None, duration: float | None = None) -> run.SoakOptions:
    cfg = ShuttleConfig(memory=384 << 20, workload="idle", qemu=Path("/bin/true"),
                        accel="tcg", accel_reason="test")
    return run.SoakOptions(names=names or ["checker-plain", "disk-copy"], ledger=path,
                           hops=hops, duration=duration, inject_every=every, shuttle=cfg)


def _exit(opts: run.SoakOptions) -> int:
    return cli._run(opts)


def test_clean_soak_writes_every_hop_and_exits_0(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    assert _exit(_opts(p, hops=6, every=3)) == 0
    es = ledger.read(p)
    assert [e["hop"] for e in es] == [1, 2, 3, 4, 5, 6]
    assert [e["combination"] for e in es[:2]] == ["checker-plain", "disk-copy"]
    assert [e["fault"]["kind"] if e["fault"] else None for e in es] == [
        None, None, "ram-stamped", None, None, "disk-stamped"]
    assert all(e["fault"]["caught"] for e in es if e["fault"])
    disk, checker = "verify:mem=32M,disk=16M+disk:bs=8K,rate=1M", "verify:mem=32M,disk=16M"
    assert fake.last.boot_text == "verify:mem=32M,disk=16M"  # the first hop's load
    assert fake.last.loads == [disk, checker, disk, checker, disk]  # changed between hops


def test_resume_numbers_on_and_keeps_the_fault_rhythm(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    assert _exit(_opts(p, hops=4, every=3)) == 0
    assert _exit(_opts(p, hops=4, every=3)) == 0
    es = ledger.read(p)
    assert [e["hop"] for e in es] == list(range(1, 9))
    assert [e["hop"] for e in es if e["fault"]] == [3, 6]  # not reset by the restart
    assert es[4]["combination"] == "checker-plain"  # hop 5 of the cycle


def test_uncaught_fault_fails_the_soak_and_the_ledger_says_where(fake, tmp_path):
    """The negative test: a fault injected and not named by the checker is exit 4."""
    p = tmp_path / "l.jsonl"
    fake.script = {2: "miss"}
    assert _exit(_opts(p, hops=3, every=1)) == cli.EXIT_MISMATCH
    es = ledger.read(p)
    assert len(es) == 3  # it goes on: the guest ran on
    assert es[1]["fault"]["caught"] is False and es[1]["fault"]["caught_by_guest"] == 0
    s = __import__("livemig.soak.summarize", fromlist=["x"]).summarize([p])
    assert s.problems and s.problems[0].startswith("l.jsonl hop 2 (disk-copy): injected")


def test_lost_guest_stops_the_soak(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    fake.script = {2: "lost"}
    assert _exit(_opts(p, hops=5)) == cli.EXIT_MISMATCH
    es = ledger.read(p)
    assert [e["hop"] for e in es] == [1, 2] and es[1]["guest_lost"] is True


def test_failed_hop_is_written_and_the_soak_goes_on(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    fake.script = {2: "fail"}
    assert _exit(_opts(p, hops=3)) == cli.EXIT_FAILED
    es = ledger.read(p)
    assert [e["outcome"] for e in es] == ["completed", "failed", "completed"]
    assert [e["from"] for e in es] == ["src", "dst", "dst"]  # the failed hop did not move


def test_interrupted_hop_is_not_written(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    fake.script = {3: "abort"}
    assert _exit(_opts(p, hops=10)) == cli.EXIT_INTERRUPTED
    assert [e["hop"] for e in ledger.read(p)] == [1, 2]
    fake.script = {}
    assert _exit(_opts(p, hops=1)) == 0  # resumed: hop 3 runs again
    assert [e["hop"] for e in ledger.read(p)] == [1, 2, 3]


def test_duration_bounds_the_soak(fake, tmp_path, monkeypatch):
    clock = iter(range(0, 1000, 10))  # each call 10 s later
    monkeypatch.setattr(run.time, "monotonic", lambda: float(next(clock)))
    p = tmp_path / "l.jsonl"
    assert _exit(_opts(p, hops=None, duration=35)) == 0
    assert len(ledger.read(p)) == 3




def test_a_soak_starting_on_a_diskless_load_boots_with_the_checker(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    assert _exit(_opts(p, hops=3, names=["idle-plain", "disk-copy"])) == 0
    assert fake.last.boot_text == "verify:mem=32M,disk=16M"  # the disk every load needs
    es = ledger.read(p)
    assert es[0]["combination"] == "idle-plain" and es[0]["load"] == "verify:mem=32M,disk=16M"
    assert es[2]["load"] == "idle"  # from then on, the combination's own load


def test_a_fault_due_on_a_failed_hop_moves_to_the_next(fake, tmp_path):
    p = tmp_path / "l.jsonl"
    fake.script = {3: "fail"}
    assert _exit(_opts(p, hops=4, every=3)) == cli.EXIT_FAILED  # failed, nothing bad
    es = ledger.read(p)
    assert es[2]["fault"] is None and es[2]["outcome"] == "failed"
    assert es[3]["fault"]["caught"] is True
