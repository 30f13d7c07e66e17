"""A link that dies during stop-and-copy: QMP is blocked (QEMU holds its main lock
while it sends the final state), so the kernel's acked bytes of the migration
connections are watched and a dead final send is yanked out-of-band. Pure logic and
a scripted source (the real link: tests/testbed/test_crash_link_vm.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from livemig.engine import monitor as monitor_mod
from livemig.engine.events import EventStream
from livemig.engine.monitor import Monitor
from livemig.engine.sockstat import parse_acked, tcp_port
from livemig.engine.stall import SwitchoverWatch

SS = """0  0  10.78.0.1:50362 10.78.0.2:4444
\t bbr wscale:10,10 rto:208 bytes_sent:134518 bytes_retrans:34518 bytes_acked:100001 segs_out:6
0  0  10.78.0.1:50364 10.78.0.2:4444
\t cubic bytes_sent:20 bytes_acked:21 segs_out:2
"""


def test_acked_bytes_are_summed_over_the_connections():
    assert parse_acked(SS) == 100022
    assert parse_acked("") is None


@pytest.mark.parametrize("uri,port", [("tcp:10.78.0.2:4444", 4444), ("tcp:[::1]:5", 5),
                                      ("unix:/run/x.sock", None), ("tcp:h:x", None)])
def test_tcp_port(uri, port):
    assert tcp_port(uri) == port


def test_moving_acks_are_never_a_stall_stuck_ones_are():
    w = SwitchoverWatch(5.0, lambda: None)
    for t in range(20):  # a slow but live final send: 20 s, acks moving
        assert w.feed(float(t), t * 1000) is None
    assert w.feed(21.0, 19000) is None  # unchanged since t=19
    assert w.feed(23.9, 19000) is None
    reason = w.feed(24.0, 19000)
    assert reason and "stall-timeout 5s" in reason and "switchover" in reason


def test_unknown_acks_or_an_answer_restart_the_watch():
    w = SwitchoverWatch(5.0, lambda: None)
    w.feed(0.0, 7)
    assert w.feed(4.0, None) is None  # the connection closed (completed): unknown
    assert w.feed(8.0, 7) is None and w.feed(12.0, 7) is None
    w.reset()  # QMP answered
    assert w.feed(14.0, 7) is None
    assert w.feed(19.0, 7) is not None
    assert SwitchoverWatch(0, lambda: None).feed(100.0, 1) is None  # off


class BlockedSource:
    """A source whose main loop is held: ``query-migrate`` answers only after a
    ``yank`` (then the migration has failed and QEMU resumed the guest)."""

    name = "src"
    pid = None
    ram_file = None

    def __init__(self, yank_frees: bool = True) -> None:
        self.freed = asyncio.Event()
        self.yank_frees = yank_frees
        self.calls: list[str] = []
        self.polls = 0

    def alive(self) -> bool:
        return True

    async def has_command(self, command: str) -> bool:
        return False

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        await asyncio.sleep(min(timeout, 0.01))
        return None

    async def cmd(self, command: str, **args: Any) -> Any:
        self.calls.append(command)
        if command != "query-migrate":
            return {}
        self.polls += 1
        if self.polls == 1:
            return {"status": "active", "ram": {"transferred": 1}}
        if self.freed.is_set():
            return {"status": "failed", "error-desc": "Channel error: shutdown"}
        await asyncio.wait_for(self.freed.wait(), 5.0)  # stop-and-copy on a dead link
        return {"status": "failed", "error-desc": "Channel error: shutdown"}

    async def oob(self, command: str, **args: Any) -> Any:
        self.calls.append(f"oob {command} {args}")
        if self.yank_frees:
            self.freed.set()
        return {}


class NoHooks:
    async def on_poll(self, now: float, obs: Any) -> dict[str, Any]:
        return {}

    def disk_observation(self) -> None:
        return None

    async def pre_switchover(self) -> bool:
        return False

    def destination_dead(self) -> None:
        return None


def _monitor(src: BlockedSource, acked: list[int | None]) -> Monitor:
    def progress() -> int | None:
        return acked.pop(0) if len(acked) > 1 else acked[0]

    return Monitor(src, EventStream(), 0.01, 0.0, None, asyncio.Event(), None, NoHooks(),
                   [], stall_timeout=0.3, switchover=SwitchoverWatch(0.3, progress))


def test_a_dead_final_send_is_yanked_and_the_migration_fails_with_why(monkeypatch):
    monkeypatch.setattr(monitor_mod, "LOOK_S", 0.05)
    src = BlockedSource()
    end = asyncio.run(_monitor(src, [5, 9, 9]).run())
    assert end.status == "failed"
    assert end.cancelled_for and "acknowledged no migration bytes" in end.cancelled_for
    assert "oob yank {'instances': [{'type': 'migration'}]}" in src.calls
    assert "migrate_cancel" not in src.calls  # it would wait for the main lock too


def test_a_live_final_send_is_not_yanked(monkeypatch):
    """The negative: acks keep moving while QMP is blocked; no yank. (QMP answers
    once the send is done: here the test frees it after a while.)"""
    monkeypatch.setattr(monitor_mod, "LOOK_S", 0.05)
    src = BlockedSource(yank_frees=False)
    counter = iter(range(1, 10**6))

    async def go() -> Any:
        mon = Monitor(src, EventStream(), 0.01, 0.0, None, asyncio.Event(), None,
                      NoHooks(), [], stall_timeout=0.3,
                      switchover=SwitchoverWatch(0.3, lambda: next(counter) * 4096))
        asyncio.get_running_loop().call_later(1.0, src.freed.set)
        return await mon.run()

    end = asyncio.run(go())
    assert not any(c.startswith("oob") for c in src.calls)
    assert end.status == "failed" and end.cancelled_for is None
