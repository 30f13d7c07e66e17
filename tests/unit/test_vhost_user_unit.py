"""--net parsing, the vhost-user QEMU arguments, the switch's counters, the stream."""

import subprocess
import sys

import pytest

from livemig.errors import UsageError
from livemig.lab.net import NetSpec, parse_net
from livemig.testbed.stream import BUCKET_S, StreamStats
from livemig.testbed.vswitch import parse_port_counters


@pytest.mark.parametrize("text,kind,queues", [
    ("tap", "tap", 1), ("vhost-user", "vhost-user", 1),
    ("vhost-user,queues=2", "vhost-user", 2), (" vhost-user,queues=8 ", "vhost-user", 8),
])
def test_parse_net(text, kind, queues):
    assert parse_net(text) == NetSpec(kind, queues)


@pytest.mark.parametrize("text", ["vhost", "", "tap,queues=2", "vhost-user,queues=0",
                                  "vhost-user,queues=9", "vhost-user,queues=x",
                                  "vhost-user,queue=2", "vhost-user,queues"])
def test_parse_net_rejects(text):
    with pytest.raises(UsageError, match="bad --net"):
        parse_net(text)


def test_qemu_args_tap_unchanged():
    args = NetSpec().qemu_args("52:54:00:00:00:01", "tap0", None)
    assert args == ["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
                    "-device", "virtio-net-pci,netdev=net0,mac=52:54:00:00:00:01,romfile="]


def test_qemu_args_vhost_user_multiqueue(tmp_path):
    sock = tmp_path / "vhu0.sock"
    args = NetSpec("vhost-user", 2).qemu_args("52:54:00:00:00:01", "tap0", sock)
    assert f"socket,id=vhu0,path={sock},server=on" in args
    assert "vhost-user,id=net0,chardev=vhu0,queues=2" in args
    assert args[-1].endswith(",mq=on,vectors=6")  # 2N+2: N rx, N tx, config, control


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "livemig.cli", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args", [
    ["migrate", "--net", "vhost"],
    ["migrate", "--net", "vhost-user,queues=0"],
    ["migrate", "--net", "tap,queues=2"],
    ["migrate", "--net", "vhost-user", "--link", "local"],
    ["migrate", "--net", "vhost-user", "--src-qmp", "/x", "--dst-qmp", "/y", "--uri", "tcp:h:1"],
])
def test_bad_net_is_one_line_exit_2(args):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("livemig: error:"), r.stderr
    assert "--net" in lines[0]


DPCTL = """netdev@ovs-netdev:
  lookups: hit:10 missed:3 lost:0
  flows: 2
  port 0: ovs-netdev (tap)
    RX packets:0 errors:0 dropped:0 overruns:0 frame:0
    TX packets:0 errors:0 dropped:0 aborted:0 carrier:0
    collisions:0
    RX bytes:0  TX bytes:0
  port 1: vhu0 (dpdkvhostuserclient: configured_rx_queues=2, configured_tx_queues=2)
    RX packets:1234 errors:0 dropped:0 overruns:? frame:?
    TX packets:5678 errors:? dropped:0 aborted:? carrier:?
    collisions:?
    RX bytes:99  TX bytes:98
  port 2: vh0
    RX packets:7 errors:0 dropped:0 overruns:0 frame:0
    TX packets:8 errors:0 dropped:0 aborted:0 carrier:0
"""


def test_port_counters_from_dpctl():
    assert parse_port_counters(DPCTL, "vhu0") == {"rx_packets": 1234, "tx_packets": 5678}
    assert parse_port_counters(DPCTL, "vh0") == {"rx_packets": 7, "tx_packets": 8}
    assert parse_port_counters(DPCTL, "vhu1") == {"rx_packets": -1, "tx_packets": -1}
    assert parse_port_counters("", "vhu0")["rx_packets"] == -1


def test_stream_rate_counts_whole_buckets_only():
    st = StreamStats()
    t0 = 1000.0
    for i in range(20):  # 2 s of 1000 bytes per 100 ms bucket
        st.buckets[int(t0 / BUCKET_S) + i] = 1000
    assert st.rate(t0, t0 + 1.0) == pytest.approx(10_000, rel=0.01)
    assert st.rate(t0, t0 + 0.05) is None
