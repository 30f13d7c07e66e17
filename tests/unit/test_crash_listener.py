"""After an abort: a destination that never held the guest is quit (its incoming
port closes); one that can still take a migration, is loading, or holds a loaded
guest is left alone. Scripted QMP (the real QEMU: tests/vm/test_attach_vm.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fakeqmp import FakeEnd
from livemig.engine import listener
from livemig.engine.guardian import repair_ends


class Incoming(FakeEnd):
    """A destination whose runstate and incoming status are scripted; ``incoming``
    lists successive incoming statuses (the last repeats)."""

    def __init__(self, state: str, incoming: list[str]) -> None:
        super().__init__("dst", status=state)
        self.incoming = list(incoming)
        self.quit = False

    async def cmd(self, command: str, **args: Any) -> Any:
        if command == "query-migrate":
            self.log.append((command, args))
            st = self.incoming.pop(0) if len(self.incoming) > 1 else self.incoming[0]
            return {} if st == "none" else {"status": st}
        if command == "quit":
            self.log.append((command, args))
            self.quit = True
            return {}
        return await super().cmd(command, **args)


def _quit(dst: Incoming) -> tuple[bool, list[str]]:
    said: list[str] = []
    return asyncio.run(listener.quit_unused_destination(dst, said.append)), said


@pytest.mark.parametrize("incoming", ["setup", "failed", "cancelled"])
def test_a_waiting_destination_that_never_held_the_guest_is_quit(incoming):
    dst = Incoming("inmigrate", [incoming])
    quit_, said = _quit(dst)
    assert quit_ and dst.quit
    assert len(said) == 1 and "never held the guest" in said[0] and incoming in said[0]


@pytest.mark.parametrize("state,incoming", [
    ("inmigrate", "none"),        # no migrate-incoming yet: it can still take one
    ("paused", "completed"),      # loaded (e.g. held after a failed comparison)
    ("running", "completed"),     # the guest runs there
    ("running", "postcopy-active"),
])
def test_a_destination_with_a_use_left_is_not_quit(state, incoming):
    dst = Incoming(state, [incoming])
    assert _quit(dst) == (False, []) and not dst.quit


def test_a_destination_still_loading_is_waited_for_then_quit_once_failed(monkeypatch):
    monkeypatch.setattr(listener, "POLL_S", 0.0)
    dst = Incoming("inmigrate", ["active", "active", "failed"])
    assert _quit(dst)[0] and dst.quit


def test_a_destination_loading_past_the_wait_is_left_alone(monkeypatch):
    monkeypatch.setattr(listener, "POLL_S", 0.01)
    monkeypatch.setattr(listener, "SETTLE_S", 0.05)
    dst = Incoming("inmigrate", ["active"])
    assert _quit(dst) == (False, []) and not dst.quit


def test_guardian_quits_the_unused_destination_after_the_source_runs():
    src = FakeEnd("src", statuses=["active"])
    src.migrating = True
    dst = Incoming("inmigrate", ["active", "failed"])
    done = asyncio.run(repair_ends(src, dst, {}))
    assert src.called("migrate_cancel") and src.status == "running"
    assert dst.quit, done
    assert any("destination quit" in a for a in done["actions"])
    # the source resumed (or ran on) before the destination was quit
    assert dst.log[-1][0] == "quit"


def test_guardian_can_be_told_to_leave_the_destination():
    src = FakeEnd("src", statuses=["active"])
    src.migrating = True
    dst = Incoming("inmigrate", ["failed"])
    asyncio.run(repair_ends(src, dst, {"quit_unused_destination": False}))
    assert not dst.quit
