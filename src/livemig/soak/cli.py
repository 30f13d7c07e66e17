"""``livemig soak``: the subcommand's arguments, their checks, and its exit status."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from livemig.errors import FaultInjectionRefused, UsageError
from livemig.soak import combos, summarize
from livemig.units import parse_size

DEFAULT_LEDGER = Path("soak.jsonl")
DEFAULT_MEMORY = "384M"  # the largest load plus the guest's own ~160 MiB, with room
EXIT_FAILED = 1  # a hop failed or the guest was lost
EXIT_MISMATCH = 4  # a mismatch, or an injected fault not caught
EXIT_INTERRUPTED = 130  # Ctrl-C: the ledger holds every finished hop
FAULT_ENV = "LIVEMIG_ALLOW_FAULT_INJECTION"

DOC = """\
Boot one small guest on the testbed's src host and migrate it src -> dst -> src ...,
each hop with the next feature combination (encodings, throttles, drain, deferral,
copied storage, link rates, guest loads; 'livemig soak --combos list'). Every hop is
verified three ways: the host's exact RAM comparison, the disk comparison when the disk
is copied, and the guest's own stamp-and-verify checker. Each hop is one JSON line in
the ledger; --resume continues after its last hop. --inject-every N corrupts one hop's
destination in every N on purpose (needs LIVEMIG_ALLOW_FAULT_INJECTION=1): the host
comparison and the guest checker must both name it.

--path libvirt soaks the way users run instead: a libvirt domain (the same guest)
defined on the testbed's src libvirt daemon and migrated between the two daemons with
'livemig migrate --domain', through its own combinations ('--path libvirt --combos
list'); verified by the in-stream RAM digest, the NBD disk comparison of copied disks
and the guest's checker; no fault injection. Ctrl-C leaves the domain running where it
is (said on exit).

exit status: 0 every hop completed and verified (and every fault caught), 1 a hop
failed or the guest was lost, 2 bad usage, 4 a mismatch or an uncaught fault (the
ledger names the hop), 130 interrupted (the ledger holds every finished hop).
With --summarize: 0 the ledgers are clean, 4 they record a problem."""


def register(sub: Any) -> None:
    s = sub.add_parser("soak", help="migrate one guest back and forth for hours through "
                       "every feature combination, one ledger line per verified hop",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=DOC)
    s.add_argument("--hops", type=int, help="hops to run now (default 50 unless "
                   "--duration)")
    s.add_argument("--duration", type=float, metavar="S", help="start no hop after S seconds")
    s.add_argument("--ledger", type=Path, default=DEFAULT_LEDGER,
                   help=f"the JSON-lines ledger (default {DEFAULT_LEDGER})")
    s.add_argument("--resume", action="store_true", help="continue after the ledger's "
                   "last hop (without it, an existing non-empty ledger is refused)")
    s.add_argument("--path", choices=combos.PATHS, default="lab",
                   help="lab (default): the lab's ping-pong of a guest livemig boots; "
                   "libvirt: a libvirt domain between the testbed's two libvirt daemons, "
                   "each hop 'livemig migrate --domain' (its own combinations)")
    s.add_argument("--combos", metavar="LIST", help="all (default), list (print them and "
                   "exit), or a comma-separated subset in cycling order")
    s.add_argument("--inject-every", type=int, metavar="N", help="one injected fault per "
                   f"N hops (needs {FAULT_ENV}=1)")
    s.add_argument("--summarize", nargs="+", type=Path, metavar="LEDGER",
                   help="print the per-combination table of these ledgers and exit")
    s.add_argument("--since", type=int, default=1, metavar="HOP", help="with "
                   "--summarize: only hops from HOP on (e.g. after a fix of the soak "
                   "itself; the ledger keeps everything)")
    s.add_argument("--memory", default=DEFAULT_MEMORY, help=f"guest RAM (default "
                   f"{DEFAULT_MEMORY})")
    s.add_argument("--max-time", type=float, default=180.0, help="per hop, seconds "
                   "(default 180)")
    s.add_argument("--qemu", type=Path, help="QEMU binary (default build/qemu/...)")
    s.add_argument("--accel", default="auto", help="auto|kvm|tcg")
    s.set_defaults(func=cmd_soak)


def cmd_soak(a: argparse.Namespace) -> int:
    if a.summarize:
        if a.since < 1:
            raise UsageError(f"--since {a.since}: hops count from 1")
        s = summarize.summarize(a.summarize, since=a.since)
        print(summarize.report(s))
        return EXIT_MISMATCH if not s.clean else 0
    if a.combos is not None and a.combos.strip() == "list":
        for c in combos.catalogue(a.path).values():
            print(f"{c.name:27} {c.describe()}")
        return 0
    opts = _options(a)
    return _run(opts)


def _options(a: argparse.Namespace) -> Any:
    from livemig.accel import choose_accel
    from livemig.lab.leftovers import reap
    from livemig.paths import default_qemu, ensure_root
    from livemig.pingpong import ShuttleConfig
    from livemig.soak import ledger
    from livemig.soak.run import SoakOptions

    names = combos.select(a.combos, a.path)
    if a.hops is not None and a.hops < 1:
        raise UsageError("--hops must be at least 1")
    if a.duration is not None and not (math.isfinite(a.duration) and a.duration > 0):
        raise UsageError("--duration must be a positive number of seconds")
    if not (math.isfinite(a.max_time) and a.max_time > 0):
        raise UsageError("--max-time must be a positive number of seconds")
    hops = a.hops if a.hops is not None or a.duration is not None else 50
    if a.inject_every is not None and a.path == "libvirt":
        raise UsageError("--inject-every applies to lab hops only: faults are injected at "
                         "the lab's verify hold, which a libvirt migration has not")
    if a.path == "libvirt" and a.accel == "kvm":
        raise UsageError("--path libvirt: the domain runs under TCG (type 'qemu'); "
                         "--accel kvm is for lab hops")
    if a.inject_every is not None:
        if a.inject_every < 1:
            raise UsageError("--inject-every must be at least 1")
        if os.environ.get(FAULT_ENV) != "1":
            raise FaultInjectionRefused(f"--inject-every corrupts the migrated guest on "
                                        f"purpose; set {FAULT_ENV}=1 to allow it")
        if not any(combos.for_hop([n], 1).fault_kind for n in names):
            raise UsageError("--inject-every needs a combination whose load runs the "
                             "guest checker (not only idle ones)")
    memory = parse_size(a.memory, "--memory")
    if memory < combos.memory_needed() + (160 << 20):
        raise UsageError(f"--memory {a.memory} is too small for the soak's loads (at "
                         f"least {(combos.memory_needed() >> 20) + 160}M)")
    if a.ledger.is_dir():
        raise UsageError(f"--ledger {a.ledger} is a directory")
    existing = ledger.read(a.ledger)  # a bad ledger: one line, before anything boots
    if existing and not a.resume:
        raise UsageError(f"ledger {a.ledger} already has {len(existing)} hops: pass "
                         "--resume to continue it, or another --ledger")
    ensure_root()
    reap()
    choice = choose_accel(a.accel)
    first = combos.for_hop(names, ledger.state(existing).last_hop + 1)
    cfg = ShuttleConfig(memory=memory, workload=first.workload,
                        qemu=a.qemu or default_qemu(), accel=choice.name,
                        accel_reason=choice.reason, max_time=a.max_time)
    return SoakOptions(names=names, ledger=a.ledger, hops=hops, duration=a.duration,
                       inject_every=a.inject_every, shuttle=cfg, path=a.path)


def _run(opts: Any) -> int:
    from livemig.soak.run import Soak

    def say(line: str) -> None:
        print(f"livemig: {line}", file=sys.stderr, flush=True)

    say(f"soak: {len(opts.names)} combinations ({opts.path} path), ledger {opts.ledger}, "
        f"accel {'tcg (libvirt domain)' if opts.path == 'libvirt' else opts.shuttle.accel}")
    soak = Soak(opts, say)

    async def go() -> Any:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, soak.interrupt)
        return await soak.run()

    out = asyncio.run(go())
    print(f"hops             {out.hops} (hops {out.first_hop}.."
          f"{out.first_hop + out.hops - 1}), {out.ok} ok, {out.failed} failed, {out.bad} bad; "
          f"faults caught {out.caught}/{out.faults}")
    print(f"ledger           {opts.ledger}")
    if out.bad:
        return EXIT_MISMATCH
    if out.failed or out.lost:
        return EXIT_FAILED
    if out.interrupted:
        return EXIT_INTERRUPTED
    return 0
