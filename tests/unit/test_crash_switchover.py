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
from livemig.engine.sockstat import LinkState, parse_state, tcp_port
from livemig.engine.stall import SwitchoverWatch

SS = """0  0  10.78.0.1:50362 10.78.0.2:4444
\t bbr wscale:10,10 rto:208 bytes_sent:134518 bytes_retrans:34518 bytes_acked:100001 segs_out:6
0  0  10.78.0.1:50364 10.78.0.2:4444
\t cubic bytes_sent:20 bytes_acked:21 segs_out:2
"""


# ss -tinH state connected: a zero-window peer (reads nothing, its kernel answers:
# lastack fresh) and, after the source closed, a dead link (FIN-WAIT-1, no ACK for 12 s)
SLOW_READER = """ESTAB 0      4067840 10.78.0.1:55752 10.78.0.2:4444
\t bbr rto:208 backoff:1 bytes_sent:176128 bytes_acked:128513 lastack:100 notsent:4067840
"""
DEAD_AFTER_CLOSE = """FIN-WAIT-1 0      65536 10.78.0.1:55752 10.78.0.2:4444
\t cubic rto:3328 backoff:4 bytes_sent:176128 bytes_acked:110593 lastack:12000
TIME-WAIT 0      0 10.78.0.1:55760 10.78.0.2:4444
"""


def test_acked_bytes_are_summed_over_the_connections():
    st = parse_state(SS)
    assert st is not None and st.acked == 100022 and st.pending == 0
    assert st.last_ack_s is None  # nothing waits to be acked
    assert parse_state("") is None


def test_pending_bytes_and_the_last_ack_are_read_in_every_connected_state():
    slow = parse_state(SLOW_READER)
    assert slow == LinkState(acked=128513, pending=4067840, last_ack_s=0.1)
    dead = parse_state(DEAD_AFTER_CLOSE)
    assert dead == LinkState(acked=110593, pending=65536, last_ack_s=12.0)


def _link(acked: int, pending: int = 4096, last_ack_s: float | None = None) -> LinkState:
    return LinkState(acked, pending, last_ack_s)


def test_a_slow_reader_or_nothing_to_send_is_not_a_dead_link():
    w = SwitchoverWatch(5.0, lambda: None)
    w.feed(0.0, _link(7, last_ack_s=0.1))
    assert w.feed(9.0, _link(7, last_ack_s=0.2)) is None  # zero window, probes answered
    w = SwitchoverWatch(5.0, lambda: None)
    w.feed(0.0, _link(7, pending=0))
    assert w.feed(9.0, _link(7, pending=0)) is None  # the source has nothing queued
    w = SwitchoverWatch(5.0, lambda: None)
    w.feed(0.0, _link(7, last_ack_s=1.0))
    assert w.feed(9.0, _link(7, last_ack_s=10.0)) is not None  # no ACK at all: dead


@pytest.mark.parametrize("uri,port", [("tcp:10.78.0.2:4444", 4444), ("tcp:[::1]:5", 5),
                                      ("unix:/run/x.sock", None), ("tcp:h:x", None)])
def test_tcp_port(uri, port):
    assert tcp_port(uri) == port


def test_moving_acks_are_never_a_stall_stuck_ones_are():
    w = SwitchoverWatch(5.0, lambda: None)
    for t in range(20):  # a slow but live final send: 20 s, acks moving
        assert w.feed(float(t), _link(t * 1000)) is None
    assert w.feed(21.0, _link(19000)) is None  # unchanged since t=19
    assert w.feed(23.9, _link(19000)) is None
    reason = w.feed(24.0, _link(19000))
    assert reason and "stall-timeout 5s" in reason and "switchover" in reason


def test_unknown_acks_or_an_answer_restart_the_watch():
    w = SwitchoverWatch(5.0, lambda: None)
    w.feed(0.0, _link(7))
    assert w.feed(4.0, None) is None  # the connection closed (completed): unknown
    assert w.feed(8.0, _link(7)) is None and w.feed(12.0, _link(7)) is None
    w.reset()  # QMP answered
    assert w.feed(14.0, _link(7)) is None
    assert w.feed(19.0, _link(7)) is not None
    assert SwitchoverWatch(0, lambda: None).feed(100.0, _link(1)) is None  # off


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
    def progress() -> LinkState | None:
        a = acked.pop(0) if len(acked) > 1 else acked[0]
        return None if a is None else _link(a)

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
                      switchover=SwitchoverWatch(0.3, lambda: _link(next(counter) * 4096)))
        asyncio.get_running_loop().call_later(1.0, src.freed.set)
        return await mon.run()

    end = asyncio.run(go())
    assert not any(c.startswith("oob") for c in src.calls)
    assert end.status == "failed" and end.cancelled_for is None
