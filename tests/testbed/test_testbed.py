"""The testbed's hosts and link, without guests: real namespaces, real tc."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from conftest import livemig_cmd
from livemig.testbed import linkrate, netns, topology

pytestmark = [pytest.mark.vm,
              pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root")]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(livemig_cmd("testbed", *args), capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def testbed():
    assert _cli("up", "--link", "1gbit").returncode == 0
    yield
    assert _cli("down").returncode == 0


@pytest.mark.parametrize("link,bits", [("100mbit", 100e6), ("1gbit", 1e9)])
def test_link_carries_the_configured_rate(testbed, link, bits):
    assert _cli("up", "--link", link).returncode == 0
    rates = [linkrate.measure(seconds=2.0) * 8 for _ in range(2)]
    best = max(rates)  # the other one may have shared the CPUs with something else
    print(f"{link}: measured {[f'{r / 1e6:.1f}' for r in rates]} Mbit/s")
    assert 0.85 * bits <= best <= 1.15 * bits


def test_up_status_down(testbed):
    st = _cli("status", "--json")
    assert st.returncode == 0
    assert '"up": true' in st.stdout
    for h in topology.BASE_HOSTS:  # dst2 only with --hosts 2
        assert netns.exists(topology.HOSTS[h])
    # the client reaches nothing but its own segment: no route to the migration link
    routes = netns.run("ip", "route", ns=topology.HOSTS["client"])
    assert "10.77.0." not in routes
    assert "tbf" in netns.run("tc", "qdisc", "show", "dev", "mig0", ns="lm-src")
    down = _cli("down")
    assert down.returncode == 0 and "lm-src" in down.stdout
    assert not topology.any_left()
    assert "testbed down" in _cli("status").stdout
    assert _cli("up").returncode == 0  # and it comes back


def test_bad_link_rate_is_one_line_error():
    p = _cli("up", "--link", "fast")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "bad link rate" in p.stderr


def test_source_link_reads_the_shaped_route(testbed):
    """The encoding model's link rate when nobody gives one: read from the route a
    process in lm-src takes to the destination (tbf on mig0), the veth's own speed
    when nothing shapes it, and nothing for a route that stays on the host."""
    from livemig.engine.linkprobe import source_link

    assert _cli("up", "--link", "100mbit").returncode == 0
    proc = subprocess.Popen(["ip", "netns", "exec", "lm-src", "sleep", "60"])
    try:
        while os.readlink(f"/proc/{proc.pid}/exe") != os.path.realpath(shutil.which("sleep") or ""):
            time.sleep(0.01)  # in lm-src once it runs sleep (ip netns exec execs it)
        link = source_link(proc.pid, topology.MIG_ADDR["dst"])
        assert link is not None and link.source == "tbf on mig0"
        assert link.rate == pytest.approx(100e6 / 8, rel=0.01)
        assert _cli("up", "--link", "none").returncode == 0
        unshaped = source_link(proc.pid, topology.MIG_ADDR["dst"])
        assert unshaped is None or unshaped.source == "mig0's speed"  # veth: 10 Gbit/s
        assert source_link(proc.pid, "10.77.0.1") is None  # its own address: local
        assert source_link(proc.pid, "no-such-host.invalid") is None
    finally:
        proc.kill()
        proc.wait()
