"""The soak's feature combinations, and how hops cycle through them and carry faults.

A combination is one point of the space the profile can choose from: the stream
encoding, the throttle (with a bandwidth cap, or it never engages), the switchover
drain, hot-page deferral, copied storage, the link's rate, and the guest's load. The
catalogue names enough points that every value of every dimension appears at least
once; hop ``n`` (counted over the whole ledger, from 1) uses ``names[(n - 1) % len]``,
so a resumed soak carries on with the combination after the last one it ran.

Post-copy (``*-postcopy``: ``postcopy-after`` switches a pre-copy that a cap keeps
long to post-copy; the destination runs the guest and pulls the rest) has no paused
moment to compare RAM at: its hops are verified by the guest's own checker (and carry
no injected fault: the lab injects at its verify hold). Not in the catalogue, because
the lab's ping-pong cannot carry it on (said in docs/verification.md): vhost-user (the
lab's switches live for one migration, so a guest handed on to the next would lose its
network).

The ``attach-*`` combinations migrate through the attach path (the two QEMUs' QMP
sockets, no lab hook: the path a user's VMs take), verified by the attach path's own
check (the in-stream RAM digest on the patched build) and the guest's checker; they
carry no injected fault (the lab injects at its verify hold, which attach has not).

The ``libvirt-*`` combinations (``livemig soak --path libvirt``, a catalogue of their
own) migrate a libvirt domain between the testbed's two daemons with ``livemig migrate
--domain`` (soak/libvirt_shuttle.py): the encodings through the livemig settings, the
converge throttle under a cap, shared and copied storage (the NBD disk check), every
load. Their link is the default 1 Gbit/s; they carry no injected fault either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from livemig.errors import UsageError
from livemig.pingpong import Combination
from livemig.spec import parse_workload

MiB = 1 << 20
# A cap low enough that the guest's dirtying outruns it, so that the throttle engages
# on this 2-core TCG host, yet a hop of a 384 MiB guest still ends within seconds.
THROTTLE_CAP = 24 * MiB
# Deferral needs pages to come round again while the stream is the bottleneck.
DEFER_CAP = 48 * MiB
SLOW_LINK = 200_000_000  # bits/s: a fifth of the default 1 Gbit/s link
FAST_LINK = 1_000_000_000

# The checker on 32 MiB of RAM and the first 16 MiB of the disk: small enough that a
# load change (which re-stamps it) takes a second or two under TCG.
CHECKER = "verify:mem=32M,disk=16M"
LOADS: dict[str, str] = {
    "idle": "idle",  # nothing: the host's RAM and disk comparisons only
    "checker": CHECKER,
    "small-writes": CHECKER + "+mem:size=64M,rate=16M,hot=80/10,touch=64",
    # small writes flat out (the vCPU's speed): the converge throttle holds it near
    # its top and the drain runs the guest on at the switchover. The one mismatch
    # ever seen (a libvirt return hop, 2026-11-27) was this, on a QEMU whose TCG
    # dirty tracking stopped after a sync (qemu/patches/0009)
    "flat-out": CHECKER + "+mem:size=64M,rate=0,hot=80/10,touch=64",
    "whole-pages": CHECKER + "+mem:size=64M,rate=16M,touch=4096,fill=random",
    "disk-writes": CHECKER + "+disk:bs=8K,rate=1M",
}
ENCODINGS = ("plain", "zstd", "lz4", "lz4-delta", "xbzrle")
THROTTLES = ("off", "converge", "direct", "auto-converge")
DEFER_PERCENT = "30"  # the reference's share (settings.PROFILES["livemig-defer"])
# Pre-copy under THROTTLE_CAP takes ~16 s for the 384 MiB guest's first pass: post-copy
# after 2 s leaves most of the RAM to be pulled by the running destination.
POSTCOPY_AFTER_S = 2.0


@dataclass(frozen=True)
class SoakCombo:
    name: str
    encoding: str = "plain"
    throttle: str = "off"
    drain: bool = False
    defer: bool = False
    storage: str = "shared"
    link: int | None = FAST_LINK
    load: str = "checker"
    profile: str = "defaults"
    via: str = "lab"
    postcopy: bool = False  # postcopy-after POSTCOPY_AFTER_S, under THROTTLE_CAP

    @property
    def bandwidth(self) -> int | None:
        if self.throttle != "off" or self.postcopy:
            return THROTTLE_CAP
        return DEFER_CAP if self.defer else None

    def combination(self) -> Combination:
        sets = {"encoding": self.encoding, "throttle": self.throttle,
                "switchover-drain": "on" if self.drain else "off"}
        if self.defer:
            sets["x-hot-page-defer-percent"] = DEFER_PERCENT
        if self.postcopy:
            sets["postcopy-after"] = f"{POSTCOPY_AFTER_S:g}"
        return Combination(sets, link=self.link, storage=self.storage,
                           bandwidth=self.bandwidth, profile=self.profile, via=self.via)

    @property
    def workload(self) -> str:
        return LOADS[self.load]

    @property
    def fault_kind(self) -> str | None:
        """The fault a hop of this combination can carry (the checker must own it).
        None through the attach and libvirt paths: faults are injected by the lab's
        verify hold, a lab hook those paths, as for a user's VMs, do not have."""
        load = parse_workload(self.workload)
        if load.verify is None or self.via != "lab" or self.postcopy:
            return None
        if self.storage == "copy" and load.verify.disk:
            return "disk-stamped"
        return "ram-stamped" if load.verify.mem else None

    def features(self) -> dict[str, Any]:
        """What the ledger records of the combination."""
        return {"encoding": self.encoding, "throttle": self.throttle, "drain": self.drain,
                "defer": self.defer, "storage": self.storage,
                "link": "unshaped" if self.link is None else f"{self.link / 1e6:g}mbit",
                "bandwidth": self.bandwidth, "load": self.load, "profile": self.profile,
                "path": self.via, "postcopy": self.postcopy}

    def describe(self) -> str:
        f = self.features()
        cap = f" cap {self.bandwidth // MiB}M/s" if self.bandwidth else ""
        return (f"{self.encoding}, throttle {self.throttle}{cap}, drain "
                f"{'on' if self.drain else 'off'}, defer {'on' if self.defer else 'off'}, "
                f"storage {self.storage}, link {f['link']}, load {self.load}"
                + (f", post-copy after {POSTCOPY_AFTER_S:g} s" if self.postcopy else "")
                + ("" if self.via == "lab" else f", via {self.via}"))


# Grouped by load: a load change restarts the guest's checker, so the catalogue keeps
# each load's combinations together and the checker runs on across them.
_CATALOGUE = (
    SoakCombo("checker-plain", load="checker"),
    SoakCombo("checker-zstd", "zstd", load="checker"),
    SoakCombo("checker-lz4-drain", "lz4", drain=True, load="checker"),
    SoakCombo("small-lz4-delta", "lz4-delta", load="small-writes"),
    SoakCombo("small-xbzrle", "xbzrle", load="small-writes"),
    SoakCombo("small-direct", "plain", "direct", load="small-writes"),
    SoakCombo("small-lz4-200mbit", "lz4", link=SLOW_LINK, load="small-writes"),
    SoakCombo("small-postcopy", "plain", load="small-writes", postcopy=True),
    SoakCombo("attach-small-lz4-delta", "lz4-delta", load="small-writes", via="attach"),
    SoakCombo("flatout-lz4-converge-drain", "lz4", "converge", drain=True, load="flat-out"),
    SoakCombo("pages-zstd", "zstd", load="whole-pages"),
    SoakCombo("pages-converge", "plain", "converge", load="whole-pages"),
    SoakCombo("pages-autoconverge", "lz4", "auto-converge", load="whole-pages"),
    SoakCombo("pages-defer", "plain", defer=True, load="whole-pages"),
    SoakCombo("pages-postcopy", "plain", load="whole-pages", postcopy=True),
    SoakCombo("attach-pages-zstd-converge", "zstd", "converge", load="whole-pages",
              via="attach"),
    SoakCombo("disk-copy", "plain", storage="copy", load="disk-writes"),
    SoakCombo("disk-copy-lz4-delta-drain", "lz4-delta", drain=True, storage="copy",
              load="disk-writes"),
    SoakCombo("disk-xbzrle-unshaped", "xbzrle", link=None, load="disk-writes"),
    SoakCombo("idle-plain", load="idle"),
    SoakCombo("idle-zstd-unshaped", "zstd", link=None, load="idle"),
)
COMBOS: dict[str, SoakCombo] = {c.name: c for c in _CATALOGUE}

# --path libvirt: grouped by load like the lab's, a shared hop first and a copied one
# second (so that two hops see both storages), every encoding, the converge throttle
_LIBVIRT = (
    SoakCombo("libvirt-checker-plain", load="checker", via="libvirt"),
    SoakCombo("libvirt-checker-zstd-copy", "zstd", storage="copy", load="checker",
              via="libvirt"),
    SoakCombo("libvirt-small-lz4-delta", "lz4-delta", load="small-writes", via="libvirt"),
    SoakCombo("libvirt-small-xbzrle", "xbzrle", load="small-writes", via="libvirt"),
    SoakCombo("libvirt-flatout-lz4-converge-drain", "lz4", "converge", drain=True,
              load="flat-out", via="libvirt"),
    SoakCombo("libvirt-pages-converge", "plain", "converge", load="whole-pages",
              via="libvirt"),
    SoakCombo("libvirt-disk-copy", "plain", storage="copy", load="disk-writes",
              via="libvirt"),
    SoakCombo("libvirt-disk-xbzrle-copy", "xbzrle", storage="copy", load="disk-writes",
              via="libvirt"),
    SoakCombo("libvirt-idle-plain", load="idle", via="libvirt"),
    SoakCombo("libvirt-idle-lz4-copy", "lz4", storage="copy", load="idle", via="libvirt"),
)
LIBVIRT_COMBOS: dict[str, SoakCombo] = {c.name: c for c in _LIBVIRT}
PATHS = ("lab", "libvirt")  # --path: the lab's ping-pong (and attach), or libvirt domains


def catalogue(path: str = "lab") -> dict[str, SoakCombo]:
    """The combinations of ``--path``: the lab's (with its attach ones) or libvirt's."""
    return LIBVIRT_COMBOS if path == "libvirt" else COMBOS


def select(spec: str | None, path: str = "lab") -> list[str]:
    """``--combos``: ``all`` (default) or a comma-separated list, in cycling order,
    from the catalogue of ``path``."""
    cat = catalogue(path)
    if spec is None or spec.strip() == "all":
        return list(cat)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in cat]
    if bad or not names:
        other = [n for n in bad if n in catalogue("lab" if path == "libvirt" else "libvirt")]
        hint = f" ({other[0]} is a combination of the other --path)" if other else ""
        raise UsageError(f"unknown combination {', '.join(bad) or '(none)'} for --path "
                         f"{path}{hint}: choose from {', '.join(cat)} (or all)")
    return names


def for_hop(names: list[str], hop: int) -> SoakCombo:
    """The combination of hop ``hop`` (1-based over the whole ledger)."""
    name = names[(hop - 1) % len(names)]
    return COMBOS[name] if name in COMBOS else LIBVIRT_COMBOS[name]


def fault_due(every: int | None, hops_since_fault: int, combo: SoakCombo) -> str | None:
    """The fault kind to inject in this hop, or None.

    One fault per ``every`` hops: once ``every`` hops have passed since the last fault
    (or the start), the next hop whose combination can carry one gets it."""
    if not every or hops_since_fault + 1 < every:
        return None
    return combo.fault_kind


def boot_load(first: SoakCombo) -> str:
    """The load the guest boots with: the first hop's, unless it has no disk.

    The guest's devices are fixed at boot, and every other load needs the disk, so a
    soak that starts (or resumes) on a diskless load boots with the checker alone; the
    ledger records the load that hop really ran."""
    w = parse_workload(first.workload)
    return first.workload if w.disk or (w.verify and w.verify.disk) else CHECKER


def memory_needed() -> int:
    """The largest load's memory (the guest is sized once, for every load)."""
    return max(parse_workload(t).mem_bytes for t in LOADS.values())
