"""``livemig pki init``: a CA and host certificates for hosts without a PKI."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from livemig.tls import creds, pki


def register(sub: Any) -> None:
    p = sub.add_parser("pki", help="TLS certificates for migrations between hosts")
    psub = p.add_subparsers(dest="pki_command", metavar="ACTION", parser_class=type(p))
    i = psub.add_parser("init", help="create a CA and per-host server and client "
                        "certificates (QEMU's tls-creds-x509 layout)",
                        description=_INIT_DOC,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("--dir", type=Path, help=f"where (default {creds.DEFAULT_DIR}; the CA "
                   "there is reused if it exists)")
    i.add_argument("--host", required=True, metavar="NAME[=ALT+ALT][,NAME...]",
                   help="one directory and certificate pair per host; NAME and each ALT "
                   "(a DNS name or an IP address) go into the certificates' subject "
                   "alternative names, e.g. lm-src=10.77.0.1,lm-dst=10.77.0.2")
    i.set_defaults(func=cmd_init)
    p.set_defaults(func=lambda a: p.print_help() or 2)


_INIT_DOC = f"""\
Create a small PKI: DIR/ca-cert.pem and DIR/ca-key.pem (the CA, reused when present)
and for each host DIR/NAME/ with ca-cert.pem, server-cert.pem, server-key.pem,
client-cert.pem, client-key.pem (keys 0600). Copy DIR/NAME/ to that host as
/etc/pki/qemu (QEMU's and libvirt's default for migration TLS) and keep ca-key.pem
off the hosts.

Without --dir, a host that already has a PKI in {' or '.join(map(str, creds.STANDARD_DIRS))}
keeps it: nothing is created, and livemig migrations use it."""


def cmd_init(a: argparse.Namespace) -> int:
    hosts = pki.parse_hosts(a.host)
    if a.dir is None:
        existing = next((d for d in creds.STANDARD_DIRS if creds.has_creds(d)), None)
        if existing is not None:
            print(f"this host has a PKI in {existing}: livemig uses it; nothing created "
                  "(give --dir to create one anyway)")
            return 0
    directory = a.dir or creds.DEFAULT_DIR
    for d in pki.init(directory, hosts):
        print(f"{d}: {', '.join(pki.QEMU_FILES)}")
    print(f"CA: {directory / 'ca-cert.pem'} (key {directory / 'ca-key.pem'}, 0600)")
    return 0
