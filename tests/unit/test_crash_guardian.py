"""livemig killed between the end of the copy and the end of the comparison: the
destination is unproven, the source intact in postmigrate. The guardian runs the
source and keeps the destination paused with its disks given back; once livemig
told it the comparison passed, the destination runs (scripted QMP)."""

from __future__ import annotations

import asyncio

from fakeqmp import FakeEnd
from livemig.engine.guardian import VERIFIED, repair_ends


def _completed() -> tuple[FakeEnd, FakeEnd]:
    src = FakeEnd("src", statuses=["completed"])
    dst = FakeEnd("dst", statuses=["completed"], commands={"blockdev-set-active"})
    src.migrating, dst.migrating = True, True
    src.status, dst.status = "postmigrate", "paused"
    return src, dst


def test_killed_while_comparing_the_source_runs_the_destination_stays_paused():
    src, dst = _completed()
    done = asyncio.run(repair_ends(src, dst, {"verify": True}))
    assert src.status == "running" and src.called("cont")
    assert not dst.called("cont") and dst.status != "running"
    assert dst.called("blockdev-set-active") == [{"active": False}]
    assert any("not verified yet" in a for a in done["actions"]), done


def test_once_verified_the_destination_runs():
    src, dst = _completed()
    asyncio.run(repair_ends(src, dst, {"verify": True, VERIFIED: True}))
    assert dst.status == "running" and not src.called("cont")


def test_without_verification_the_destination_runs():
    src, dst = _completed()
    asyncio.run(repair_ends(src, dst, {"verify": False}))
    assert dst.status == "running" and not src.called("cont")


# -- the engine tells the guardian VERIFIED only after a passing comparison -------------
URI = "tcp:127.0.0.1:4444"


def _engine_ends() -> tuple[FakeEnd, FakeEnd]:
    ram = {"pc.ram": bytearray(4 << 20)}
    digest = {"x-query-ram-digest", "blockdev-set-active"}
    src = FakeEnd("src", ram={k: bytearray(v) for k, v in ram.items()}, commands=digest)
    dst = FakeEnd("dst", status="inmigrate", commands=digest,
                  ram={k: bytearray(v) for k, v in ram.items()})
    dst.events.append({"event": "MIGRATION", "data": {"status": "completed"},
                       "timestamp": {"seconds": 1, "microseconds": 0}})
    return src, dst


def _told(monkeypatch, tmp_path, src: FakeEnd, dst: FakeEnd) -> list[str]:
    from livemig.engine import guardian
    from livemig.engine.plan import Plan
    from livemig.engine.run import Engine

    told: list[str] = []

    class Handle:
        def tell(self, word: str) -> None:
            told.append(f"{word} (dst {dst.status}, cont {len(dst.called('cont'))})")

        def dismiss(self) -> None:
            told.append("dismissed")

    monkeypatch.setattr(guardian, "start", lambda spec, d: (
        told.append(f"verify={spec['verify']}"), Handle())[1])
    plan = Plan(URI, settings=(("poll-interval", "0.01"),), profile="defaults").validate()
    asyncio.run(Engine(src, dst, plan, guardian_dir=tmp_path).run())
    return told


def test_engine_tells_verified_before_the_destination_runs(monkeypatch, tmp_path):
    src, dst = _engine_ends()
    told = _told(monkeypatch, tmp_path, src, dst)
    assert told[0] == "verify=True" and told[-1] == "dismissed", told
    assert told[1].startswith("verified") and told[1].endswith("cont 0)"), told  # before cont
    assert dst.status == "running"


def test_engine_never_tells_verified_for_a_corrupt_destination(monkeypatch, tmp_path):
    src, dst = _engine_ends()
    orig = dst.cmd

    async def corrupt(command, **args):  # type: ignore[no-untyped-def]
        if command == "x-query-ram-digest":
            dst.ram["pc.ram"][0x1000] ^= 1
        return await orig(command, **args)

    dst.cmd = corrupt  # type: ignore[method-assign]
    told = _told(monkeypatch, tmp_path, src, dst)
    assert not any(t.startswith("verified") for t in told), told
    assert any(t.startswith("refuse-destination") for t in told)
