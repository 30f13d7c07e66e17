"""The testbed's hosts and wires, created and removed as one unit.

::

      lm-src                      lm-dst
   ┌──────────────┐   mig0     ┌──────────────┐
   │ QEMU src     │◀──────────▶│ QEMU dst     │   migration link: veth, tbf both ways
   │  tap0─br0─up0│  10.77.0/24│up0─br0─tap0  │
   └──────────┬───┘            └───┬──────────┘
              │      lm-client     │
              └──to-src─br0─to-dst─┘             guest network: one L2 segment
                   10.78.0.100                   guest 10.78.0.10

Everything lives inside the three namespaces, so deleting them removes every link,
bridge, tap and qdisc; nothing outside is touched. A lock file makes one testbed
user at a time; a state file remembers who made it and at what link rate.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig import paths
from livemig.errors import SetupError
from livemig.testbed import netns

HOSTS = {"src": "lm-src", "dst": "lm-dst", "client": "lm-client", "dst2": "lm-dst2"}
MIG_ADDR = {"src": "10.77.0.1", "dst": "10.77.0.2", "dst2": "10.77.2.3"}
# the hosts every testbed has; dst2 (a second destination, for evacuations) only
# with ``testbed up --hosts 2``: its own migration link from src (mig2 in lm-src,
# 10.77.2.1 <-> 10.77.2.3, shaped like mig0) and its br0 on the guest network
BASE_HOSTS = ("src", "dst", "client")
EXTRA_DST = "dst2"
EXTRA_SRC_ADDR = "10.77.2.1"
EXTRA_MIG_IF = "mig2"  # its end in lm-src; in lm-dst2 it is mig0 like dst's
MIG_PREFIX = 24
GUEST_IP = "10.78.0.10"
CLIENT_IP = "10.78.0.100"
GUEST_PREFIX = 24
GUEST_MAC = "52:54:00:4c:4d:0a"
TAP = "tap0"
MIG_IF = "mig0"
DEFAULT_LINK = "1gbit"


def state_file() -> Path:
    return paths.run_root() / "testbed.json"


def lock_file() -> Path:
    return paths.run_root() / "testbed.lock"


@dataclass(frozen=True)
class LinkShape:
    rate_bits: int | None  # None = unshaped

    def tbf_args(self) -> list[str]:
        assert self.rate_bits is not None
        rate_bytes = self.rate_bits // 8
        # veth hands tbf GSO packets up to 64 KiB: the bucket must hold several, and
        # ~4 ms of traffic so that the timer granularity does not cap the rate.
        burst = max(rate_bytes // 250, 256 << 10)
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst),
                "latency", "50ms"]


def is_up() -> bool:
    return all(netns.exists(HOSTS[h]) for h in BASE_HOSTS)


def has_dst2() -> bool:
    return netns.exists(HOSTS[EXTRA_DST])


def destinations() -> list[str]:
    """The destination hosts of the testbed as it is now."""
    return ["dst", EXTRA_DST] if has_dst2() else ["dst"]


def any_left() -> bool:
    return any(netns.exists(ns) for ns in HOSTS.values())


def read_state() -> dict[str, Any]:
    try:
        return dict(json.loads(state_file().read_text()))
    except (OSError, ValueError):
        return {}


def up(link: int | None, owner: str) -> None:
    """Create the three hosts and their wires (repairing leftovers first)."""
    if any_left():
        down(quiet=True)
    state_file().parent.mkdir(parents=True, exist_ok=True)
    try:
        _create(link)
    except BaseException:
        down(quiet=True)
        raise
    state_file().write_text(json.dumps({"link_bits": link, "owner": owner,
                                        "created": time.time()}))


def _create(link: int | None) -> None:
    run = netns.run
    for ns in (HOSTS[h] for h in BASE_HOSTS):
        run("ip", "netns", "add", ns)
        run("ip", "link", "set", "lo", "up", ns=ns)
    src, dst, cli = HOSTS["src"], HOSTS["dst"], HOSTS["client"]
    # migration link
    run("ip", "link", "add", MIG_IF, "netns", src, "type", "veth",
        "peer", "name", MIG_IF, "netns", dst)
    for side in ("src", "dst"):
        ns = HOSTS[side]
        run("ip", "addr", "add", f"{MIG_ADDR[side]}/{MIG_PREFIX}", "dev", MIG_IF, ns=ns)
        run("ip", "link", "set", MIG_IF, "up", ns=ns)
    set_link(link)
    # guest network: a bridge per host, the client's bridge joins the other two
    for ns in (src, dst, cli):
        run("ip", "link", "add", "br0", "type", "bridge", "forward_delay", "0",
            "stp_state", "0", ns=ns)
        run("ip", "link", "set", "br0", "up", ns=ns)
    for side in ("src", "dst"):
        ns = HOSTS[side]
        run("ip", "link", "add", "up0", "netns", ns, "type", "veth",
            "peer", "name", f"to-{side}", "netns", cli)
        run("ip", "link", "set", "up0", "master", "br0", "up", ns=ns)
        run("ip", "link", "set", f"to-{side}", "master", "br0", "up", ns=cli)
        run("ip", "tuntap", "add", "dev", TAP, "mode", "tap", ns=ns)
        run("ip", "link", "set", TAP, "master", "br0", "up", ns=ns)
    run("ip", "addr", "add", f"{CLIENT_IP}/{GUEST_PREFIX}", "dev", "br0", ns=cli)


def set_link(link: int | None) -> None:
    """Shape both directions of the migration link(s) (None: unshaped)."""
    ends = [(HOSTS["src"], MIG_IF), (HOSTS["dst"], MIG_IF)]
    if has_dst2():
        ends += [(HOSTS["src"], EXTRA_MIG_IF), (HOSTS[EXTRA_DST], MIG_IF)]
    for ns, dev in ends:
        netns.run("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        if link is not None:
            netns.run("tc", "qdisc", "add", "dev", dev, "root",
                      *LinkShape(link).tbf_args(), ns=ns)


def add_dst2(link: int | None) -> bool:
    """The second destination host on a running testbed (False: it exists already)."""
    if has_dst2():
        return False
    run = netns.run
    ns, src, cli = HOSTS[EXTRA_DST], HOSTS["src"], HOSTS["client"]
    try:
        run("ip", "netns", "add", ns)
        run("ip", "link", "set", "lo", "up", ns=ns)
        run("ip", "link", "add", EXTRA_MIG_IF, "netns", src, "type", "veth",
            "peer", "name", MIG_IF, "netns", ns)
        run("ip", "addr", "add", f"{EXTRA_SRC_ADDR}/{MIG_PREFIX}", "dev", EXTRA_MIG_IF, ns=src)
        run("ip", "link", "set", EXTRA_MIG_IF, "up", ns=src)
        run("ip", "addr", "add", f"{MIG_ADDR[EXTRA_DST]}/{MIG_PREFIX}", "dev", MIG_IF, ns=ns)
        run("ip", "link", "set", MIG_IF, "up", ns=ns)
        run("ip", "link", "add", "br0", "type", "bridge", "forward_delay", "0",
            "stp_state", "0", ns=ns)
        run("ip", "link", "set", "br0", "up", ns=ns)
        run("ip", "link", "add", "up0", "netns", ns, "type", "veth",
            "peer", "name", f"to-{EXTRA_DST}", "netns", cli)
        run("ip", "link", "set", "up0", "master", "br0", "up", ns=ns)
        run("ip", "link", "set", f"to-{EXTRA_DST}", "master", "br0", "up", ns=cli)
        set_link(link)
    except BaseException:
        run("ip", "netns", "del", ns, check=False)
        raise
    return True


def remove_dst2() -> None:
    """The second destination gone again (its daemon first: libvirtd.down)."""
    ns = HOSTS[EXTRA_DST]
    if not netns.exists(ns):
        return
    for pid in (int(p) for p in netns.run("ip", "netns", "pids", ns, check=False).split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    netns.run("ip", "netns", "del", ns, check=False)
    netns.run("ip", "link", "del", EXTRA_MIG_IF, ns=HOSTS["src"], check=False)
    netns.run("ip", "link", "del", f"to-{EXTRA_DST}", ns=HOSTS["client"], check=False)


def down(quiet: bool = False) -> list[str]:
    """Kill what runs in the hosts and delete them; return what was removed."""
    from livemig.testbed import libvirtd  # its daemons live in the hosts too

    removed: list[str] = libvirtd.down()
    for ns in HOSTS.values():
        if not netns.exists(ns):
            continue
        pids = [int(p) for p in netns.run("ip", "netns", "pids", ns, check=False).split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(pids)
        netns.run("ip", "netns", "del", ns, check=False)
        removed.append(ns + (f" ({len(pids)} processes killed)" if pids else ""))
    with contextlib.suppress(FileNotFoundError):
        state_file().unlink()
    removed += _stale_ram_files()
    if not quiet:
        for r in removed:
            print(f"removed {r}")
    return removed


def _stale_ram_files() -> list[str]:
    """Guest RAM files of runs whose QEMU is gone (a crashed or killed livemig)."""
    cmdlines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                cmdlines.append((proc / "cmdline").read_bytes())
    removed = []
    for f in paths.shm_root().glob("livemig-*.ram"):
        if not any(str(f).encode() in c for c in cmdlines):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
            removed.append(str(f))
    return removed


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < end and Path(f"/proc/{pid}").exists():
            time.sleep(0.02)


def status() -> dict[str, Any]:
    st: dict[str, Any] = {"up": is_up(), **read_state(), "hosts": {}}
    for name, ns in HOSTS.items():
        if name not in BASE_HOSTS and not netns.exists(ns):
            continue
        if not netns.exists(ns):
            st["hosts"][name] = None
            continue
        pids = netns.run("ip", "netns", "pids", ns, check=False).split()
        links = netns.run("ip", "-br", "link", ns=ns, check=False).split("\n")
        qdisc = ""
        if name != "client":
            qdisc = netns.run("tc", "qdisc", "show", "dev", MIG_IF, ns=ns, check=False).strip()
        st["hosts"][name] = {"namespace": ns, "processes": len(pids),
                             "links": [ln.split()[0] for ln in links if ln.strip()],
                             "qdisc": qdisc}
    return st


@contextlib.contextmanager
def locked(wait: float | None = None) -> Iterator[None]:
    """One user of the testbed at a time. A second one waits up to ``wait`` seconds
    (default ``LIVEMIG_TESTBED_WAIT``, 0 = fail at once) and then gets a clear
    error; test suites set a wait so that parallel runs queue instead of failing."""
    if wait is None:
        wait = float(os.environ.get("LIVEMIG_TESTBED_WAIT", "0") or 0)
    lock_file().parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file(), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SetupError("the testbed is in use by another livemig run "
                                     f"(lock {lock_file()})") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def tap_counters(side: str) -> dict[str, int]:
    """Packets through a host's tap: rx = sent by the guest, tx = sent to it."""
    text = netns.run("ip", "-j", "-s", "link", "show", "dev", TAP, ns=HOSTS[side],
                     check=False)
    try:
        stats = json.loads(text)[0]["stats64"]
    except (ValueError, LookupError):
        return {"rx_packets": -1, "tx_packets": -1}
    return {"rx_packets": int(stats["rx"]["packets"]),
            "tx_packets": int(stats["tx"]["packets"])}
