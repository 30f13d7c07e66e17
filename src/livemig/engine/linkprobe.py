"""The migration link's rate as the source host shows it.

The encoding model needs the link's rate: on a 100 Mbit/s link zstd moves a
compressible guest several times faster than plain pages, on 10 Gbit/s plain pages
win. When neither ``--bandwidth`` nor ``--set link-rate`` says it, the source host
can: the route from the source QEMU's network namespace to the destination leaves
through one device, whose rate is the lowest of

- the device's speed (``ethtool``: what the NIC negotiated), and
- a rate the host's traffic control puts on it: a root ``tbf`` qdisc, a root
  ``netem`` with a ``rate`` (how links are emulated), or the root classes of an
  ``htb`` (the slowest of them: the one migration traffic may be in).

Read with ``ip``/``ethtool``/``tc`` inside the QEMU's network namespace (``nsenter``),
so only for a source QEMU on this host. What this cannot see: a slower hop further on
(a shaped uplink, a busy switch, the destination's own shaping) and other traffic on
the link; the caller's ``--bandwidth`` or ``--set link-rate`` covers those. Loopback
and unix sockets have no link: nothing is read (the model's unshaped rate).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import urllib.parse
from dataclasses import dataclass

from livemig.engine.sockstat import in_netns

TOOL_TIMEOUT_S = 3.0
_SPEED = re.compile(r"^\s*Speed:\s*(\d+)\s*Mb/s", re.M)
_HTB_ROOT = re.compile(r"^class htb \S+ root\b.*?\brate (\d+(?:\.\d+)?)([KMGT]?)bit", re.M)
_UNIT = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Link:
    rate: float  # bytes/s
    source: str  # where the rate was read, e.g. "tbf on mig0"


def peer_of(uri: str) -> str | None:
    """The destination host in a migration URI (``tcp:HOST:PORT``, ``tcp://HOST:PORT``,
    ``rdma:HOST:PORT``) or a libvirt URI (``qemu+tcp://HOST/system``); None for a
    unix socket, ``exec:``, a URI without a host."""
    if "://" in uri:
        try:
            host = urllib.parse.urlsplit(uri).hostname
        except ValueError:  # an unclosed IPv6 bracket
            return None
        return host or None
    scheme, _, rest = uri.partition(":")
    if scheme not in ("tcp", "rdma") or not rest:
        return None
    if not rest.startswith("[") and rest.count(":") != 1:
        return None  # QEMU writes an IPv6 address in brackets
    return rest.rsplit(":", 1)[0].strip("[]") or None


def _run(pid: int, *argv: str) -> str | None:
    return in_netns(pid, *argv, timeout=TOOL_TIMEOUT_S)


def _address(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


def route_device(route_json: str) -> str | None:
    """The device of ``ip -j route get`` output."""
    try:
        routes = json.loads(route_json)
        return str(routes[0]["dev"])
    except (ValueError, LookupError, TypeError):
        return None


def device_speed(ethtool_out: str) -> float | None:
    """Bytes/s of ``ethtool DEV``'s ``Speed:``; None when it says none (``Unknown!``)."""
    m = _SPEED.search(ethtool_out)
    return int(m.group(1)) * 1e6 / 8 if m and int(m.group(1)) > 0 else None


def shaped_rate(qdisc_json: str, htb_classes: str = "") -> tuple[float, str] | None:
    """Bytes/s a root ``tbf`` or ``netem ... rate`` (``tc -j qdisc show``), or the
    slowest root ``htb`` class (``tc class show``'s text: its JSON is not implemented
    for htb) lets through."""
    try:
        qdiscs = json.loads(qdisc_json) if qdisc_json.strip() else []
    except ValueError:
        return None
    for q in qdiscs if isinstance(qdiscs, list) else []:
        if not isinstance(q, dict) or not q.get("root"):
            continue
        if q.get("kind") == "tbf":
            rate = (q.get("options") or {}).get("rate")
            if isinstance(rate, (int, float)) and rate > 0:
                return float(rate), "tbf"
        if q.get("kind") == "netem":
            rate = ((q.get("options") or {}).get("rate") or {})
            rate = rate.get("rate") if isinstance(rate, dict) else None
            if isinstance(rate, (int, float)) and rate > 0:
                return float(rate), "netem"
        if q.get("kind") == "htb":
            rates = [float(v) * _UNIT[u] / 8 for v, u in _HTB_ROOT.findall(htb_classes)]
            if rates:
                return min(rates), "htb"
    return None


def source_link(pid: int, peer: str) -> Link | None:
    """The rate of the device the route from ``pid``'s network namespace to ``peer``
    leaves by; None when that cannot be read, or the route stays on this host."""
    addr = _address(peer)
    if addr is None:
        return None
    dev = route_device(_run(pid, "ip", "-j", "route", "get", addr) or "")
    if dev is None or dev == "lo":
        return None
    found: list[tuple[float, str]] = []
    speed = device_speed(_run(pid, "ethtool", dev) or "")
    if speed is not None:
        found.append((speed, f"{dev}'s speed"))
    qdisc = _run(pid, "tc", "-j", "qdisc", "show", "dev", dev) or ""
    classes = ""
    if '"htb"' in qdisc:
        classes = _run(pid, "tc", "class", "show", "dev", dev) or ""
    shaped = shaped_rate(qdisc, classes)
    if shaped is not None:
        found.append((shaped[0], f"{shaped[1]} on {dev}"))
    if not found:
        return None
    rate, source = min(found)
    return Link(rate, source)
