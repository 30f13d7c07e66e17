"""The plan of one migration: frozen, validated once before anything boots.

Everything the engine will do is decided from the plan plus what the two QEMUs
report; every entry point (lab, attach, bench, verify) builds one the same way.
QEMU capabilities/parameters in ``wanted`` are checked against the QEMU later
(:mod:`livemig.engine.negotiate`): only the QEMU knows its own knobs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from livemig.errors import UsageError
from livemig.settings import LIVEMIG_SETTINGS, PROFILES, is_on, postcopy_planned
from livemig.tls.creds import Tls

# --max-time when none is given: a full pass of a 64 GiB guest at 1 Gbit/s takes about
# 9 minutes; a migration still running after 15 is not converging, and meanwhile holds
# the guest throttled and the link busy for nothing (the source keeps running).
DEFAULT_MAX_TIME_S = 900.0

_URI = re.compile(r"^(tcp:(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):\d{1,5}|unix:/.+)$")


@dataclass(frozen=True)
class Plan:
    uri: str  # what the destination listens on: tcp:HOST:PORT or unix:PATH
    settings: tuple[tuple[str, str], ...] = ()  # profile + --set, merged
    explicit: frozenset[str] = frozenset()  # keys given with --set (never overridden)
    profile: str = "livemig"
    bandwidth: int | None = None  # bytes/s cap on the migration stream
    max_time: float | None = None  # cancel after this many seconds
    verify: bool = True  # compare the frozen source with the paused destination
    accel: str = "tcg"
    pause_before_switchover: bool = False  # a disk mirror finishes with the guest frozen
    disk_link: float | None = None  # bytes/s the disk policies share (disk copied)
    # debug, ``livemig verify --inject`` only (fault injection allowed explicitly):
    # resume a destination that failed verification, so the guest's own checker can
    # be shown to find the injected fault too. Never for a real migration.
    resume_corrupt: bool = False
    tls: Tls | None = None  # x509 credentials and the one peer accepted; None: plain

    @property
    def wanted(self) -> dict[str, str]:
        return dict(self.settings)

    def livemig_settings(self) -> dict[str, Any]:
        """Every livemig setting, converted, with its default when not given."""
        out: dict[str, Any] = {k: st.default for k, st in LIVEMIG_SETTINGS.items()}
        for key, value in self.settings:
            if key in LIVEMIG_SETTINGS:
                out[key] = LIVEMIG_SETTINGS[key].kind(value)
        return out

    def livemig_setting(self, key: str) -> str:
        return self.wanted.get(key, str(LIVEMIG_SETTINGS[key].default))

    @property
    def postcopy(self) -> bool:
        """The migration may turn to post-copy (postcopy-ram on: ``on-stall=postcopy``,
        ``postcopy-after``, or the capability set), which rules out what QEMU refuses
        beside it (the patched build's lz4 delta cache)."""
        return (postcopy_planned(self.livemig_settings())
                or is_on(self.wanted.get("postcopy-ram", "off")))

    def with_settings(self, extra: Mapping[str, str]) -> Plan:
        merged = {**self.wanted, **extra}
        return dataclasses.replace(self, settings=tuple(merged.items()))

    def with_uri(self, uri: str) -> Plan:
        return dataclasses.replace(self, uri=uri).validate()

    def with_tls(self, tls: Tls | None) -> Plan:
        return dataclasses.replace(self, tls=tls)

    def validate(self) -> Plan:
        """One-line :class:`UsageError` for anything wrong; returns self."""
        if self.uri and not _URI.match(self.uri):
            raise UsageError(f"bad migration URI {self.uri!r}: expected tcp:HOST:PORT or "
                             "unix:/PATH")
        if self.uri.startswith("tcp:"):
            port = int(self.uri.rsplit(":", 1)[1])
            if not 0 < port < 65536:
                raise UsageError(f"bad migration URI {self.uri!r}: port out of range")
        if self.profile not in PROFILES:
            raise UsageError(f"unknown profile {self.profile!r}: choose from "
                             f"{', '.join(PROFILES)}")
        if self.max_time is not None and not (math.isfinite(self.max_time)
                                              and self.max_time > 0):
            raise UsageError("--max-time must be a positive number of seconds")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise UsageError("--bandwidth must be positive")
        for key, value in self.settings:
            if key.startswith("tls-") and key in self.explicit:
                raise UsageError(f"--set {key}: TLS is --tls on|off|auto (and --tls-dir); "
                                 "livemig adds the credential objects and removes them")
            st = LIVEMIG_SETTINGS.get(key)
            if st is None:
                continue
            try:
                st.kind(value)
            except (ValueError, UsageError):
                raise UsageError(f"bad --set {key}={value}: {st.doc}") from None
        if self.livemig_setting("disk-check") != "auto":
            raise UsageError("--set disk-check is for libvirt runs (--domain with --storage "
                             "copy), not lab or attach runs")
        throttle = self.livemig_setting("throttle")
        if throttle == "dirty-limit" and self.accel != "kvm":
            raise UsageError("throttle=dirty-limit needs KVM with a dirty ring; this run "
                             f"uses {self.accel} (use reference, staged or auto-converge)")
        return self
