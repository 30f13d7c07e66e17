"""Profiles and ``--set key=value`` overrides.

A setting is one of three kinds, decided against what the QEMU binary in use
reports (``query-migrate-capabilities`` / ``query-migrate-parameters``) so that a
patched and a stock QEMU are both handled and a typo is caught:

- a QEMU migration capability (boolean),
- a QEMU migration parameter (its type taken from QEMU's current value),
- a livemig control-plane setting (registered in ``LIVEMIG_SETTINGS``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from livemig.errors import UsageError
from livemig.units import parse_link_rate, parse_size

_TRUE = {"on", "true", "yes", "1"}
_FALSE = {"off", "false", "no", "0"}


@dataclass(frozen=True)
class LivemigSetting:
    default: Any
    kind: Callable[[str], Any]
    doc: str


def _onoff(value: str) -> bool:
    return _bool("value", value)


def _choice(*choices: str) -> Callable[[str], str]:
    def conv(value: str) -> str:
        if value not in choices:
            raise ValueError(value)
        return value
    return conv


def _client_stream(value: str) -> str:
    """off | udp | tcp; the boolean spellings of before stay: on = udp."""
    v = value.lower()
    if v in _TRUE or v == "udp":
        return "udp"
    if v in _FALSE:
        return "off"
    if v == "tcp":
        return v
    raise ValueError(value)


def _granularity(value: str) -> int | str:
    if value == "auto":
        return value
    g = parse_size(value, "disk-granularity")
    if g < 512 or g > 64 << 20 or g & (g - 1):
        raise ValueError(value)
    return g


def _link(value: str) -> str:
    """auto, or a link rate such as 400mbit / 10gbit (kept as given)."""
    if value != "auto":
        parse_link_rate(value)
    return value


def _budget(value: str) -> int | str:
    """auto, or milliseconds (0: no limit)."""
    if value == "auto":
        return value
    return int(_number(0, 3_600_000, int)(value))


def ram_check_budget_s(livemig: Mapping[str, Any]) -> float | None:
    """The resolved ``ram-check-budget`` in seconds; None: no limit. ``auto`` is the
    run's ``max-downtime``: the longest pause it accepts for the switchover."""
    value = livemig.get("ram-check-budget", "auto")
    ms = livemig.get("max-downtime", 1000) if value == "auto" else value
    return float(ms) / 1000.0 if ms else None


def _bytes(value: str) -> int:
    return parse_size(value, "size")


def _number(lo: float, hi: float, kind: Callable[[str], Any] = float
            ) -> Callable[[str], Any]:
    """A finite number in [lo, hi] (``nan``, ``inf`` and out-of-range values are
    refused: a poll interval of 0 would spin, a negative one would never wait)."""
    def conv(value: str) -> Any:
        x = kind(value)
        if not math.isfinite(x) or not lo <= x <= hi:
            raise ValueError(value)
        return x
    return conv


LIVEMIG_SETTINGS: dict[str, LivemigSetting] = {
    "warmup": LivemigSetting(3.0, _number(0, 3600),
                             "seconds of workload measured before migrating (0 to 3600)"),
    "settle": LivemigSetting(2.0, _number(0, 3600),
                             "seconds the guest is observed after the end (0 to 3600)"),
    "poll-interval": LivemigSetting(0.25, _number(0.01, 10.0),
                                    "seconds between query-migrate polls (0.01 to 10)"),
    "stall-timeout": LivemigSetting(10.0, _number(0, 3600),
                                    "seconds with no migration bytes moving before the "
                                    "switchover after which the migration is cancelled and "
                                    "the throttle dropped (a dead link); 0: off. 10 s: a "
                                    "live link moves bytes every poll, and TCP's first "
                                    "retransmissions are over well within it"),
    "throttle": LivemigSetting("off", _choice(
        "off", "auto-converge", "reference", "direct", "staged", "converge", "dirty-limit"),
        "off|auto-converge|reference|direct|staged|converge|dirty-limit"),
    "downtime-ramp": LivemigSetting(False, _onoff,
                                    "raise downtime-limit while rounds do not shrink"),
    "switchover-bandwidth": LivemigSetting(
        False, _onoff, "once the first pass is over, set QEMU's avail-switchover-bandwidth "
        "to the rate the stream achieves while it has work queued (again when that moves "
        "by 20 %), so that the switchover does not wait on QEMU's estimate of the last "
        "100 ms (which falls near zero when the last rounds carry a few pages each)"),
    "max-downtime": LivemigSetting(1000, _number(1, 600_000, int),
                                   "ceiling of the downtime ramp, ms (1 to 600000)"),
    "on-stall": LivemigSetting("force", _choice("force", "abort", "postcopy"),
                               "force|abort|postcopy when the strategy is exhausted"),
    "postcopy-after": LivemigSetting(0.0, _number(0, 86_400),
                                     "seconds of pre-copy after which the migration "
                                     "switches to post-copy if it has not completed "
                                     "(0: never); the destination then runs the guest "
                                     "and pulls the pages it still lacks"),
    "disk-granularity": LivemigSetting(
        64 << 10, _granularity, "dirty-bitmap granularity of the disk mirror (--storage "
        "copy): auto (from the guest's write sizes) or a power of two, 512 to 64M"),
    "disk-schedule": LivemigSetting("libvirt", _choice("first", "libvirt", "concurrent"),
                                    "first: disk copy, then RAM with a growing share of "
                                    "the link; libvirt: disk copy, then RAM, no sharing; "
                                    "concurrent: both at once"),
    "io-qos": LivemigSetting(False, _onoff, "cap guest disk writes while the disk "
                             "remainder does not shrink"),
    "encoding": LivemigSetting("off", _choice("off", "auto", "xbzrle", "zstd", "lz4",
                                              "lz4-delta", "plain"),
                               "stream encoding: auto (from a sample of the pages the "
                               "guest rewrites, the link and the CPU left), xbzrle, "
                               "zstd, lz4, lz4-delta (lz4 multifd with delta encoding "
                               "of re-sent pages), plain, or off "
                               "(as set)"),
    "link-rate": LivemigSetting("auto", _link,
                                "the migration link's rate for the encoding model, e.g. "
                                "1gbit or 10gbit: auto (the testbed's link in lab runs, "
                                "else the source host's route to the destination: its "
                                "device's speed or tbf/netem/htb rate, for a QEMU on this "
                                "host; else 10gbit; --bandwidth caps it)"),
    "sampler": LivemigSetting("auto", _choice("auto", "qemu", "procmem", "pmemsave", "xp",
                                                     "peek", "file"),
                              "how encoding=auto samples the guest's pages: auto (the "
                              "patched QEMU's x-calc-ram-sample, else /proc/PID/mem for "
                              "a QEMU on this host livemig may trace (a domain's too), "
                              "libvirt's memory peek for a domain elsewhere, pmemsave "
                              "for a QEMU on this host livemig may not trace, HMP xp "
                              "elsewhere), qemu, procmem, peek, pmemsave, xp, or file "
                              "(the lab's shared RAM file)"),
    "pin": LivemigSetting("off", _choice("off", "auto", "on"),
                          "pin the source's migration threads away from its vCPUs "
                          "(auto: only with a spare host CPU)"),
    "disk-speed": LivemigSetting(0, _bytes, "disk mirror speed cap, bytes/s (0: none)"),
    "disk-copy-mode": LivemigSetting("background",
                                     _choice("background", "write-blocking", "ready"),
                                     "mirror copy mode: background, write-blocking, or "
                                     "ready (background for the first full pass, so "
                                     "guest writes never wait behind the bulk copy; "
                                     "write-blocking once in sync, so nothing is copied "
                                     "twice)"),
    "client-stream": LivemigSetting("off", _client_stream, "testbed: a stream from the "
                                    "client to the guest from boot to the end, in the "
                                    "report's network.stream. udp (or on): datagrams to "
                                    "the guest's echo, a window of 32 x 1400 B in "
                                    "flight, echoed payload/s; tcp: one TCP connection "
                                    "to the guest's sink (port 7778) sending flat out: "
                                    "acked bytes/s before, during and after the "
                                    "migration, the longest stall (no new bytes acked), "
                                    "retransmits and whether the connection survived; "
                                    "off"),
    "ram-check": LivemigSetting("auto", _choice("auto", "file", "digest"),
                                "how guest RAM is verified: auto (RAM files when both ends "
                                "have one, else QEMU's RAM digest), file, digest"),
    "ram-check-budget": LivemigSetting(
        "auto", _budget,
        "ms the guest may wait paused for the RAM comparison (QEMU's digest of both "
        "ends, ~0.05-0.15 s per GiB): all of RAM when it fits, else random ranges of "
        "it until the budget is spent (the report's coverage); a libvirt run, whose "
        "check QEMU does whole inside the switchover, leaves it off when its estimate "
        "does not fit. auto: max-downtime; 0: no limit"),
    "disk-check": LivemigSetting("auto", _choice("auto", "nbd", "file", "stream"),
                                 "how a libvirt run verifies copied disks (--storage "
                                 "copy): nbd (read-only NBD exports of a QEMU on each "
                                 "host: guest-visible data, any format), file (both "
                                 "image files on this machine, the testbed), stream "
                                 "(libvirt's volume streams, raw), auto (nbd, falling "
                                 "back to file or stream when it cannot run)"),
    "switchover-drain": LivemigSetting(
        "off", _choice("auto", "on", "off"),
        "before the switchover, wait until the destination has loaded what was sent "
        "(patched QEMU's x-switchover-drain, with return-path): on, off, or auto (on "
        "when the QEMU has it)"),
}

# patched QEMU (qemu/patches/0007): the capability behind switchover-drain, and the
# one it requires
DRAIN_CAP = "x-switchover-drain"
DRAIN_NEEDS = "return-path"
# patched QEMU (qemu/patches/0012): a running migration may change its multifd codec
SWITCH_CAP = "x-multifd-compression-switch"

# Stock QEMU only: these are the baselines livemig is judged against.
PROFILES: dict[str, dict[str, str]] = {
    "defaults": {},
    "upstream": {
        "auto-converge": "on", "multifd": "on", "multifd-channels": "2",
        "multifd-compression": "zstd", "multifd-zstd-level": "1",
    },
    "upstream-xbzrle": {"auto-converge": "on", "xbzrle": "on", "xbzrle-cache-size": "256M"},
    "upstream-plain": {"auto-converge": "on"},
    # Everything livemig has, on: the stream encoding chosen from the guest's pages,
    # the link and the CPU (lz4 delta for small writes), the converge throttle
    # through the patched set-cpu-throttle instead of auto-converge's ladder, a
    # downtime ramp, the stream's own rate for QEMU's switchover decision, and a
    # forced switchover as the last resort.
    "livemig": {"encoding": "auto", "throttle": "converge",
                "downtime-ramp": "on", "max-downtime": "1000",
                "switchover-bandwidth": "on", "on-stall": "force",
                "io-qos": "on", "pin": "auto", "disk-schedule": "first",
                "disk-granularity": "auto", "disk-copy-mode": "ready",
                "switchover-drain": "auto"},
}
# livemig plus QEMU's hot-page deferral (patch 3/3, experimental: x-) at the reference's
# 30 %: kept apart until a benchmark shows it pays (docs/results/)
PROFILES["livemig-defer"] = {**PROFILES["livemig"], "x-hot-page-defer-percent": "30"}


def parse_sets(items: list[str]) -> dict[str, str]:
    """``["a=1", "b=on"]`` → ``{"a": "1", "b": "on"}`` with one-line errors."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise UsageError(f"bad --set {item!r}: expected key=value")
        out[key] = value.strip()
    return out


def merge(profile: str, sets: dict[str, str]) -> dict[str, str]:
    """The profile's settings overridden by ``--set``, plus what those imply.

    Asking for a multifd compression method or channel count means using multifd;
    multifd and xbzrle exclude each other in QEMU, so a profile's xbzrle gives way
    (an explicit ``--set xbzrle=on`` does not, and QEMU will say why)."""
    wanted = profile_settings(profile)
    wanted.update(sets)
    wants_multifd = sets.get("multifd-compression", "none") != "none" or (
        "multifd-channels" in sets)
    if wants_multifd and "multifd" not in sets:
        wanted["multifd"] = "on"
        if "xbzrle" not in sets and wanted.get("xbzrle") == "on":
            wanted["xbzrle"] = "off"
    return wanted


def profile_settings(profile: str) -> dict[str, str]:
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}: choose from {', '.join(PROFILES)}")
    return dict(PROFILES[profile])


def postcopy_planned(livemig: Mapping[str, Any]) -> bool:
    """The livemig settings (converted) may turn the migration to post-copy: it
    needs postcopy-ram from the start."""
    return livemig["on-stall"] == "postcopy" or float(livemig.get("postcopy-after") or 0) > 0


def is_on(value: str) -> bool:
    """A setting's value reads as on (``on``, ``true``, ``yes``, ``1``)."""
    return value.lower() in _TRUE


def _bool(key: str, value: str) -> bool:
    v = value.lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"bad --set {key}={value}: expected on or off")


@dataclass
class Resolved:
    """Settings split by kind, with values converted to the right types."""

    capabilities: dict[str, bool] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    livemig: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "capabilities": dict(self.capabilities),
            "parameters": dict(self.parameters),
            "livemig": dict(self.livemig),
        }


def resolve(
    wanted: Mapping[str, str],
    qemu_caps: Mapping[str, bool],
    qemu_params: Mapping[str, Any],
) -> Resolved:
    """Classify and convert ``wanted`` against what this QEMU supports."""
    res = Resolved()
    res.livemig = {k: s.default for k, s in LIVEMIG_SETTINGS.items()}
    for key, value in wanted.items():
        if key in LIVEMIG_SETTINGS:
            setting = LIVEMIG_SETTINGS[key]
            try:
                res.livemig[key] = setting.kind(value)
            except (ValueError, UsageError):
                raise UsageError(f"bad --set {key}={value}: {setting.doc}") from None
            # settings that need a QEMU capability on both ends from the start
            if key == "throttle" and value == "auto-converge":
                res.capabilities["auto-converge"] = True
            if key == "throttle" and value == "dirty-limit" and "dirty-limit" in qemu_caps:
                res.capabilities["dirty-limit"] = True
            if (key == "on-stall" and value == "postcopy") or (
                    key == "postcopy-after" and res.livemig[key]):
                if "postcopy-ram" not in qemu_caps:
                    raise UsageError(f"{key}={value}: this QEMU has no postcopy-ram")
                res.capabilities["postcopy-ram"] = True
            if key == "switchover-drain":
                _switchover_drain(res, value, qemu_caps)
        elif key in qemu_caps:
            res.capabilities[key] = _bool(key, value)
        elif key in qemu_params:
            res.parameters[key] = _convert_param(key, value, qemu_params[key])
        else:
            hint = did_you_mean(key, [*qemu_caps, *qemu_params])
            raise UsageError(
                f"unknown setting {key!r}: not a livemig setting, nor a migration capability "
                f"or parameter of this QEMU (is it the patched build?){hint}"
            )
    return res


def did_you_mean(key: str, qemu_names: list[str]) -> str:
    """``; did you mean 'x'?`` for the closest livemig setting or QEMU capability or
    parameter name to a misspelt ``key`` (empty when none is close)."""
    close = difflib.get_close_matches(key, [*LIVEMIG_SETTINGS, *qemu_names], n=1, cutoff=0.8)
    return f"; did you mean {close[0]!r}?" if close else ""


def _switchover_drain(res: Resolved, value: str, qemu_caps: Mapping[str, bool]) -> None:
    """``switchover-drain``: the capability, and ``return-path`` (QEMU refuses the
    capability without it) on both ends; ``auto`` only where the QEMU has it."""
    if DRAIN_CAP not in qemu_caps:
        if value == "on":
            raise UsageError(f"switchover-drain=on: this QEMU has no {DRAIN_CAP} "
                             "capability (the patched build has it)")
        return
    on = value != "off"
    res.capabilities[DRAIN_CAP] = on
    if on:
        res.capabilities[DRAIN_NEEDS] = True


def _convert_param(key: str, value: str, current: Any) -> Any:
    if isinstance(current, bool):
        return _bool(key, value)
    if isinstance(current, int):
        try:
            return int(value)
        except ValueError:
            return parse_size(value, f"--set {key}")
    if isinstance(current, float):
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"bad --set {key}={value}: expected a number") from None
    return value
