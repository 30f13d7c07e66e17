"""``livemig migrate --domain NAME --connect SRC_URI --to DST_URI``."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any
from urllib.parse import urlsplit

from livemig.errors import FaultInjectionRefused, UsageError
from livemig.progress import Progress
from livemig.report import summary
from livemig.settings import merge, parse_sets
from livemig.tls.creds import enabled, libvirt_one_host
from livemig.units import parse_size
from livemig.virt import record
from livemig.virt.plan import MIGRATIONS_AT_ONCE_ENV, STOCK_FOUND_ENV, STOCK_PEER_ENV, Request
from livemig.virt.run import DomainOptions, run_domain_migration

# options of a lab run (livemig boots the guest) that mean nothing for a domain
LAB_ONLY = ("memory", "vcpus", "workload", "link", "qemu", "accel", "disk_size", "net",
            "disk_fill", "keep_run_dir", "run_id", "qemu_trace")
FAULT_ENV = "LIVEMIG_ALLOW_FAULT_INJECTION"


def options(a: argparse.Namespace, defaults: dict[str, Any]) -> DomainOptions:
    if not a.connect or not a.to:
        raise UsageError("--domain needs --connect SRC_URI and --to DST_URI")
    given = [k for k in LAB_ONLY if getattr(a, k, None) != defaults.get(k)]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')} is for lab runs (livemig boots "
                         "the guest), not with --domain")
    if a.max_time is not None and not (math.isfinite(a.max_time) and a.max_time > 0):
        raise UsageError("--max-time must be positive")
    if getattr(a, "tls_dir", None) is not None:
        raise UsageError("--tls-dir is for attach runs: under libvirt each daemon's "
                         "qemu.conf names its certificates (migrate_tls_x509_cert_dir)")
    if a.report and a.report.is_dir():
        raise UsageError(f"--report {a.report} is a directory")
    sets = parse_sets(a.set)
    kind, offset = _fault(a.inject_fault, a.storage)
    req = Request(storage=a.storage,
                  bandwidth=parse_size(a.bandwidth, "--bandwidth") if a.bandwidth else None,
                  unsafe=a.unsafe, verify=not a.no_verify, migrate_uri=a.migrate_uri,
                  ram_fault=offset if kind == "ram-byte" else None,
                  tls=enabled(a.tls, one_host=libvirt_one_host(a.connect, a.to)),
                  tls_destination=urlsplit(a.to).hostname)
    told = os.environ.get(STOCK_PEER_ENV, "").strip()  # livemig evacuate's knowledge
    return DomainOptions(domain=a.domain, src_uri=a.connect, dst_uri=a.to,
                         profile=a.profile, wanted=merge(a.profile, sets),
                         explicit=frozenset(sets), request=req, max_time=a.max_time,
                         disk_fault=offset if kind == "disk-byte" else None,
                         stock_peer=bool(told), stock_told=told,
                         stock_found=os.environ.get(STOCK_FOUND_ENV) or None,
                         at_once=_at_once())


def _at_once() -> int:
    """How many migrations ``livemig evacuate`` runs at once from the source
    (MIGRATIONS_AT_ONCE_ENV); 1 for a run of its own or a value that is not a count."""
    try:
        return max(1, int(os.environ.get(MIGRATIONS_AT_ONCE_ENV, "1")))
    except ValueError:
        return 1


def _fault(items: list[str], storage: str) -> tuple[str | None, int | None]:
    """``--inject-fault disk-byte@OFFSET`` (a byte of the destination's copied image,
    flipped before the images are compared) or ``ram-byte@OFFSET`` (a byte of the
    destination's main RAM block, flipped by its QEMU just before the in-stream RAM
    check): one fault per libvirt run."""
    if not items:
        return None, None
    if os.environ.get(FAULT_ENV) != "1":
        raise FaultInjectionRefused(f"--inject-fault corrupts the migrated guest on "
                                    f"purpose; set {FAULT_ENV}=1 to allow it")
    kind, sep, addr = items[0].partition("@")
    if len(items) > 1 or kind not in ("disk-byte", "ram-byte") or not sep:
        raise UsageError("with --domain only one --inject-fault disk-byte@OFFSET or "
                         "ram-byte@OFFSET")
    if kind == "disk-byte" and storage != "copy":
        raise UsageError("--inject-fault disk-byte needs --storage copy")
    try:
        offset = int(addr, 0)
    except ValueError:
        raise UsageError(f"bad --inject-fault offset {addr!r}") from None
    if kind == "ram-byte" and offset <= 0:
        raise UsageError("--inject-fault ram-byte@OFFSET: OFFSET must be positive")
    return kind, offset


def cmd_migrate_domain(a: argparse.Namespace, defaults: dict[str, Any]) -> int:
    opts = options(a, defaults)
    run = run_domain_migration(opts, Progress(enabled=not a.quiet))
    rep = record.report(run)
    from livemig.cli import finish_run  # the CLI imports this module lazily

    return finish_run(rep, a.report, summary(rep))
