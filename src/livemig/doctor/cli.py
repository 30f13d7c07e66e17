"""``livemig doctor URI [--emulator PATH] [--tls on|off]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from livemig.errors import UsageError

EXIT_CANNOT = 1  # the host cannot take part (a fail line); bad input is 2

_DOC = """Check a libvirt host before an evacuation: libvirt and QEMU versions, the
emulator libvirt would use (or --emulator) and which livemig mechanisms it has,
whether it finds its firmware with no -L, the daemon's migration TLS certificates,
KVM, free memory, running domains. One line per finding (ok, warn, fail); exit 1 when
the host cannot take part, 0 otherwise. The emulator, qemu.conf and /dev/kvm are
checked only when the host's files are visible here (this machine, or the testbed's
hosts); for another machine run the doctor there (qemu:///system)."""


def register(sub: Any) -> None:
    d = sub.add_parser("doctor", help="check a libvirt host before an evacuation",
                       description=_DOC)
    d.add_argument("uri", metavar="URI", help="the host's libvirt daemon, e.g. "
                   "qemu:///system or livemig testbed libvirt-uri dst")
    d.add_argument("--emulator", type=Path, metavar="PATH", help="check this QEMU instead "
                   "of the one libvirt names by default (the domains' <emulator>)")
    d.add_argument("--tls", choices=("on", "off"), default="on", help="whether migrations "
                   "to and from this host are encrypted (livemig's default between hosts: "
                   "on)")
    d.set_defaults(func=cmd_doctor)


def cmd_doctor(a: argparse.Namespace) -> int:
    from livemig.doctor.checks import can_take_part, check
    from livemig.doctor.gather import gather

    if "://" not in a.uri:
        raise UsageError(f"{a.uri!r} is not a libvirt URI (e.g. qemu:///system, "
                         "qemu+tls://HOST/system)")
    if a.emulator is not None and not a.emulator.is_file():
        raise UsageError(f"--emulator {a.emulator}: no such file")
    findings = check(gather(a.uri, a.emulator, a.tls == "on"))
    for f in findings:
        print(f.line())
    if can_take_part(findings):
        warns = sum(f.level == "warn" for f in findings)
        print(f"host can take part ({warns} warning{'' if warns == 1 else 's'})")
        return 0
    fails = sum(f.level == "fail" for f in findings)
    print(f"host cannot take part ({fails} failure{'' if fails == 1 else 's'})")
    return EXIT_CANNOT
