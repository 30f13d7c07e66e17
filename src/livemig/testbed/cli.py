"""``livemig testbed up|down|status|measure``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from livemig.paths import ensure_root
from livemig.testbed import linkrate, topology
from livemig.units import parse_link_rate


def register(sub: Any) -> None:
    t = sub.add_parser("testbed", help="the src/dst/client hosts (network namespaces)",
                       description="Hosts as network namespaces: src and dst joined by a "
                       "shaped migration link, and a client on the guests' L2 network. "
                       "'livemig migrate' brings it up by itself when needed.")
    tsub = t.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)
    u = tsub.add_parser("up", help="create the hosts (or reshape the link of a running one)")
    u.add_argument("--link", default=topology.DEFAULT_LINK,
                   help="migration link rate: 100mbit, 1gbit, 10gbit or none "
                        f"(default {topology.DEFAULT_LINK})")
    u.add_argument("--libvirt", action="store_true",
                   help="also start a libvirt daemon in each of src and dst (own "
                        "directories and host UUID; plain TCP without auth: a test lab)")
    u.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="destination hosts: 1 (dst) or 2 (dst and dst2, each with its own "
                        "shaped link from src; for livemig evacuate) (default 1)")
    u.set_defaults(func=_up)
    lu = tsub.add_parser("libvirt-uri", help="print the connection URI of a host's "
                         "libvirt daemon (testbed up --libvirt)")
    lu.add_argument("host", choices=("src", "dst", "dst2"))
    fl = tsub.add_parser("fleet", help="define and start N small domains with mixed "
                         "workloads on src's libvirt daemon (for livemig evacuate)")
    fl.add_argument("--count", type=int, default=4, help="domains (default 4)")
    fl.add_argument("--memory", default="160M", help="RAM per domain (default 160M)")
    fl.add_argument("--prefix", default="fleet", help="domain names PREFIX-N (default fleet)")
    fl.add_argument("--qemu", help="the domains' emulator (default: build/qemu's)")
    fl.add_argument("--kind", choices=("mixed", "busy"), default="mixed",
                    help="mixed: idle and light writers (default); busy: databases and "
                    "caches that do not converge without a delta encoding or a throttle")
    fl.set_defaults(func=_fleet)
    lu.set_defaults(func=_libvirt_uri)
    d = tsub.add_parser("down", help="remove the hosts and everything in them "
                        "(also repairs what a crashed run left)")
    d.set_defaults(func=_down)
    s = tsub.add_parser("status", help="what exists now")
    s.add_argument("--json", action="store_true", help="machine-readable")
    s.set_defaults(func=_status)
    m = tsub.add_parser("measure", help="measure the link rate with a bulk TCP transfer")
    m.add_argument("--seconds", type=float, default=2.0, help="transfer time (default 2)")
    m.set_defaults(func=_measure)


def _up(a: argparse.Namespace) -> int:
    ensure_root()
    link = parse_link_rate(a.link)
    with topology.locked():
        if topology.is_up():
            topology.set_link(link)
            state = topology.read_state()
            state["link_bits"] = link
            topology.state_file().write_text(json.dumps(state))
            print(f"testbed already up; link now {a.link}")
        else:
            topology.up(link, owner="testbed up")
            print(f"testbed up: hosts "
                  f"{', '.join(topology.HOSTS[h] for h in topology.BASE_HOSTS)}, link {a.link}")
        if a.hosts == 2 and topology.add_dst2(link):
            print(f"second destination {topology.HOSTS[topology.EXTRA_DST]}, its own link "
                  f"{a.link} from src")
        if a.libvirt:
            from livemig.testbed import libvirtd

            for side, uri in libvirtd.up().items():
                print(f"libvirtd on {side}: {uri}")
    return 0


def _libvirt_uri(a: argparse.Namespace) -> int:
    from livemig.testbed import libvirtd

    if not libvirtd.is_running(a.host):
        print(f"livemig: error: no libvirt daemon on {a.host} "
              "(livemig testbed up --libvirt)", file=sys.stderr)
        return 2
    print(libvirtd.uri(a.host))
    return 0


def _down(a: argparse.Namespace) -> int:
    ensure_root()
    from livemig.lab.leftovers import reap

    # under the lock: a run (or a test module holding the hosts) in another checkout
    # is not torn down under its feet; a dead run's lock is free (flock dies with it)
    with topology.locked():
        removed = topology.down(quiet=True)
    removed += reap()  # QEMUs and RAM files of runs whose livemig died (also --link local)
    print("removed " + ", ".join(removed) if removed else "nothing to remove")
    return 0


def _status(a: argparse.Namespace) -> int:
    from livemig.testbed import libvirtd

    st = topology.status()
    st["libvirt"] = {side: libvirtd.uri(side) if libvirtd.is_running(side) else None
                     for side in libvirtd.ALL_SIDES}
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    if not topology.any_left():
        print("testbed down")
        return 0
    bits = st.get("link_bits")
    print(f"testbed {'up' if st['up'] else 'PARTIAL (run: livemig testbed down)'}, "
          f"link {'unshaped' if bits is None else f'{bits / 1e6:g} Mbit/s'}, "
          f"owner {st.get('owner', '?')}")
    for name, h in st["hosts"].items():
        if h is None:
            print(f"  {name:7} missing")
        else:
            print(f"  {name:7} {h['namespace']}: {h['processes']} processes, links "
                  f"{', '.join(h['links'])}" + (f"; {h['qdisc']}" if h["qdisc"] else "")
                  + (f"; libvirtd {st['libvirt'][name]}" if st["libvirt"].get(name) else ""))
    return 0


def _measure(a: argparse.Namespace) -> int:
    ensure_root()
    if not topology.is_up():
        print("livemig: error: the testbed is down (livemig testbed up)")
        return 2
    with topology.locked():
        rate = linkrate.measure(a.seconds)
    bits = topology.read_state().get("link_bits")
    line = f"link carried {rate * 8 / 1e6:.1f} Mbit/s ({rate / 2**20:.1f} MiB/s)"
    if bits:
        line += f", {100 * rate * 8 / bits:.0f}% of the configured {bits / 1e6:g} Mbit/s"
    print(line)
    return 0


def _fleet(a: argparse.Namespace) -> int:
    from pathlib import Path

    from livemig.evacuate import testfleet
    from livemig.units import parse_size

    ensure_root()
    if a.count < 1:
        print("livemig: error: --count must be at least 1", file=sys.stderr)
        return 2
    memory = parse_size(a.memory, "--memory")
    names = testfleet.define(a.count, memory >> 20, a.prefix,
                             Path(a.qemu) if a.qemu else None, a.kind)
    for name, workload in names.items():
        print(f"{name}: {workload}")
    return 0
