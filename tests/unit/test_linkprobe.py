"""The link's rate for the encoding model: the parsers of what the source host shows
(ip, ethtool, tc) and which source wins; the real namespaces are in
tests/testbed/test_testbed.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from livemig.engine import adapt
from livemig.engine.adapt import Hints
from livemig.engine.linkprobe import (
    Link,
    device_speed,
    peer_of,
    route_device,
    shaped_rate,
)
from livemig.engine.plan import Plan


@pytest.mark.parametrize("uri,peer", [
    ("tcp:10.77.0.2:4444", "10.77.0.2"),
    ("tcp:dst.example:4444", "dst.example"),
    ("tcp:[fd00::2]:4444", "fd00::2"),
    ("tcp://10.77.0.2:49152", "10.77.0.2"),
    ("qemu+tcp://10.77.0.2/system", "10.77.0.2"),
    ("qemu+ssh://root@host7/system", "host7"),
    ("rdma:10.1.1.1:4444", "10.1.1.1"),
    ("unix:/run/mig.sock", None),
    ("exec:cat > /dev/null", None),
    ("qemu:///system", None),
    ("tcp:fd00::2:4444", None),  # QEMU wants the brackets
    ("qemu+tcp://[fd00::2/system", None),  # malformed: no traceback
    ("", None),
])
def test_peer_of(uri: str, peer: str | None) -> None:
    assert peer_of(uri) == peer


def test_route_device() -> None:
    assert route_device('[{"dst":"10.77.0.2","dev":"mig0","prefsrc":"10.77.0.1"}]') == "mig0"
    assert route_device("") is None
    assert route_device("[]") is None


def test_device_speed() -> None:
    assert device_speed("Settings for eth0:\n\tSpeed: 25000Mb/s\n\tDuplex: Full\n") == 25e9 / 8
    assert device_speed("Settings for eth0:\n\tSpeed: Unknown!\n") is None
    assert device_speed("") is None


def test_shaped_rate_tbf_and_htb() -> None:
    tbf = ('[{"kind":"tbf","handle":"914f:","root":true,"refcnt":3,'
           '"options":{"rate":12500000,"burst":262137,"lat":50000}}]')
    assert shaped_rate(tbf) == (12500000.0, "tbf")
    htb = '[{"kind":"htb","handle":"1:","root":true,"options":{"default":"0x10"}}]'
    classes = ("class htb 1:10 root prio 0 rate 300Mbit ceil 300Mbit burst 1537b\n"
               "class htb 1:20 root prio 0 rate 2Gbit ceil 2Gbit burst 1600b\n"
               "class htb 1:21 parent 1:20 prio 0 rate 1Mbit ceil 2Gbit burst 1600b\n")
    assert shaped_rate(htb, classes) == (300e6 / 8, "htb")
    # iproute2's q_netem.c: the rate in its own object, bytes/s like tbf's
    netem = ('[{"kind":"netem","handle":"8001:","root":true,"options":{"limit":1000,'
             '"rate":{"rate":50000000,"packetoverhead":0,"cellsize":0,"celloverhead":0},'
             '"ecn":false,"gap":0}}]')
    assert shaped_rate(netem) == (50e6, "netem")
    assert shaped_rate('[{"kind":"netem","root":true,"options":{"limit":1000}}]') is None
    # a qdisc that shapes nothing, a tbf below the root (not the device's rate), junk
    assert shaped_rate('[{"kind":"fq_codel","root":true,"options":{}}]') is None
    assert shaped_rate('[{"kind":"tbf","root":false,"options":{"rate":1000}}]') is None
    assert shaped_rate("not json") is None


def _link(plan: Plan, hints: Hints, found: Link | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None,
          params: dict[str, Any] | None = None) -> tuple[float | None, str]:
    def probe(pid: int, peer: str) -> Link | None:
        assert (pid, peer) == (4242, "10.77.0.2")
        return found
    assert monkeypatch is not None
    monkeypatch.setattr(adapt, "source_link", probe)
    monkeypatch.setattr(adapt, "qemu_is_local", lambda pid: pid is not None)
    src: Any = SimpleNamespace(pid=4242)
    return asyncio.run(adapt.link_rate(src, plan, hints, params))


def test_link_rate_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = Plan("tcp:10.77.0.2:4444", profile="livemig").validate()
    tbf = Link(12.5e6, "tbf on mig0")
    # nothing said: the source host's route
    assert _link(plan, Hints(), tbf, monkeypatch) == (12.5e6, "tbf on mig0")
    # nothing readable: unknown (the model's unshaped rate)
    assert _link(plan, Hints(), None, monkeypatch) == (None, "unknown")
    # the caller's (the lab's testbed) before the host's
    assert _link(plan, Hints(link_rate=1e6), tbf, monkeypatch) == (1e6, "the testbed's link")
    # --set link-rate before both
    given = Plan(plan.uri, settings=(("link-rate", "1gbit"),), profile="livemig",
                 explicit=frozenset({"link-rate"})).validate()
    assert _link(given, Hints(link_rate=1e6), tbf, monkeypatch) == (1e9 / 8, "--set link-rate")
    # --bandwidth caps whatever was found, and only when it is lower
    capped = Plan(plan.uri, profile="livemig", bandwidth=1_000_000).validate()
    assert _link(capped, Hints(), tbf, monkeypatch) == (1e6, "--bandwidth")
    wide = Plan(plan.uri, profile="livemig", bandwidth=100_000_000).validate()
    assert _link(wide, Hints(), tbf, monkeypatch) == (12.5e6, "tbf on mig0")


def test_qemu_max_bandwidth_caps_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --bandwidth the source QEMU's max-bandwidth is the stream's cap (QEMU's
    default 128 MiB/s unless somebody set it); libvirt sets its own, so not there."""
    plan = Plan("tcp:10.77.0.2:4444", profile="livemig").validate()
    default = {"max-bandwidth": adapt.QEMU_DEFAULT_CAP}
    link, why = _link(plan, Hints(), None, monkeypatch, default)
    assert link == 128 << 20
    assert "QEMU's max-bandwidth" in why and "QEMU's default" in why and "--bandwidth" in why
    tbf = Link(12.5e6, "tbf on mig0")  # a slower link than the cap: the link
    assert _link(plan, Hints(), tbf, monkeypatch, default) == (12.5e6, "tbf on mig0")
    ten = Link(1.25e9, "speed of mig0")  # a faster one: the cap
    assert _link(plan, Hints(), ten, monkeypatch, default)[0] == 128 << 20
    set_by_user = _link(plan, Hints(), ten, monkeypatch, {"max-bandwidth": 300 << 20})
    assert set_by_user[0] == 300 << 20 and "QEMU's default" not in set_by_user[1]
    # --bandwidth is what livemig sets on QEMU: it replaces the cap, up or down
    wide = Plan(plan.uri, profile="livemig", bandwidth=1_000_000_000).validate()
    assert _link(wide, Hints(), ten, monkeypatch, default) == (1e9, "--bandwidth")
    # libvirt: its own max-bandwidth at the call, not what QEMU has now
    assert _link(plan, Hints(qemu_cap=False), ten, monkeypatch, default) \
        == (1.25e9, "speed of mig0")
    # nothing readable or no cap: as before
    assert _link(plan, Hints(), ten, monkeypatch, {"max-bandwidth": 0})[0] == 1.25e9
    assert _link(plan, Hints(), ten, monkeypatch, {})[0] == 1.25e9


def test_link_rate_peer_from_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A libvirt run's plan has no URI: the destination host comes with the hints."""
    asked: list[str] = []

    def probe(pid: int, peer: str) -> Link | None:
        asked.append(peer)
        return None
    monkeypatch.setattr(adapt, "source_link", probe)
    monkeypatch.setattr(adapt, "qemu_is_local", lambda pid: False)
    src: Any = SimpleNamespace(pid=None)
    plan = Plan("", profile="livemig").validate()
    hints = Hints(peer="10.77.0.2", local_pid=lambda: 99)
    assert asyncio.run(adapt.link_rate(src, plan, hints)) == (None, "unknown")
    assert asked == ["10.77.0.2"]
    # no QEMU on this host: nothing is read
    asked.clear()
    assert asyncio.run(adapt.link_rate(src, plan, Hints(peer="10.77.0.2"))) == (None, "unknown")
    assert asked == []
