"""What policies see (a stats snapshot) and what they return (actions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Snapshot:
    """One poll of the migration, in plain units (bytes, bytes/s, seconds)."""

    t: float  # seconds since the migration started
    rounds: int  # dirty-bitmap syncs so far (QEMU's dirty-sync-count)
    remaining: int  # RAM bytes still dirty
    dirty_rate: float  # bytes/s the guest dirties (QEMU's estimate)
    bandwidth: float  # bytes/s the stream achieved recently
    throttle_pct: int = 0
    ram_total: int = 0
    disk_remaining: int | None = None  # mirror: len - offset (bytes still to copy)
    disk_total: int | None = None
    disk_ready: bool = False  # mirror in sync (only dirty writes left)
    disk_dirty_rate: float | None = None  # bytes/s the mirror's to-do grows by (re-dirtied)
    disk_write_rate: float | None = None  # bytes/s the guest writes to the disk
    # bytes/s of guest pages the stream moves (QEMU's pages-per-second × page size):
    # unlike ``bandwidth`` (bytes on the wire) it does not shrink with compression,
    # so it is what the remainder, in guest bytes, is drained at; 0 when unknown
    page_rate: float = 0.0
    # the share of the CPU time the guest's vCPUs asked for that they got (the host's
    # contention: 1.0 on an idle host, whatever the throttle); 0 when unknown
    vcpu_share: float = 0.0

    @classmethod
    def from_query_migrate(cls, t: float, info: dict[str, Any],
                           disk: dict[str, Any] | None = None) -> Snapshot:
        """``disk``: the mirror's state (remaining, total, ready, dirty_rate, write_rate)."""
        ram = info.get("ram", {})
        d = disk or {}
        page = ram.get("page-size") or 4096
        mbps = ram.get("mbps") or 0.0
        pps = ram.get("pages-per-second") or 0
        return cls(
            t=t,
            rounds=int(ram.get("dirty-sync-count") or 0),
            remaining=int(ram.get("remaining") or 0),
            dirty_rate=float(ram.get("dirty-pages-rate") or 0) * page,
            bandwidth=float(mbps) * 1e6 / 8,
            throttle_pct=int(info.get("cpu-throttle-percentage") or 0),
            ram_total=int(ram.get("total") or 0),
            disk_remaining=d.get("remaining"),
            disk_total=d.get("total"),
            disk_ready=bool(d.get("ready")),
            disk_dirty_rate=d.get("dirty_rate"),
            disk_write_rate=d.get("write_rate"),
            page_rate=float(pps) * page,
        )


@dataclass(frozen=True)
class Action:
    """Something a policy wants done; ``reason`` goes to the report's timeline."""

    reason: str


@dataclass(frozen=True)
class SetThrottle(Action):
    percent: int  # 0..99, via set-cpu-throttle (lease renewed by the executor)


@dataclass(frozen=True)
class SetDowntimeLimit(Action):
    ms: int


@dataclass(frozen=True)
class StrategyExhausted(Action):
    """The strategy did all it can and the migration still does not converge."""


@dataclass(frozen=True)
class ForceSwitchover(Action):
    pass


@dataclass(frozen=True)
class AbortMigration(Action):
    pass


@dataclass(frozen=True)
class StartPostcopy(Action):
    pass


@dataclass(frozen=True)
class SetRamBandwidth(Action):
    bytes_per_s: int


@dataclass(frozen=True)
class SetSwitchoverBandwidth(Action):
    """QEMU's ``avail-switchover-bandwidth``: the rate its switchover decision assumes
    instead of its own estimate of the last 100 ms. ``guest_bytes``: the rate guest
    pages drain at (QEMU then switches over with as much as the limit allows), not
    the wire rate."""

    bytes_per_s: int
    guest_bytes: bool = False


@dataclass(frozen=True)
class SetCompression(Action):
    """The running stream's multifd codec (``multifd-compression``; both ends have the
    codec switch, patch 0012): its channels take it at their next packet. With
    ``delta_cache`` (bytes) lz4's delta cache is made too, new and empty (patch 0019
    lets a migration that dropped it make it again)."""

    method: str
    delta_cache: int = 0


@dataclass(frozen=True)
class SetMirrorSpeed(Action):
    bytes_per_s: int  # 0 = unlimited


@dataclass(frozen=True)
class SetIoThrottle(Action):
    write_bytes_per_s: int  # 0 = remove the cap


class Policy(Protocol):
    name: str

    def decide(self, s: Snapshot) -> list[Action]: ...


class RoundTracker:
    """Turns polls into rounds: the remaining RAM right after each bitmap sync is
    what that round found dirty."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, float, int]] = []  # (round, t, dirty bytes)
        self._last_round = -1

    def update(self, s: Snapshot) -> bool:
        """Record ``s``; True when a new round started with this snapshot."""
        if s.rounds > self._last_round:
            self._last_round = s.rounds
            if s.rounds >= 2:  # round 1 is the full pass: not a dirty amount
                self.rounds.append((s.rounds, s.t, s.remaining))
            return True
        return False

    def stalled(self, tolerance: float = 0.05) -> bool:
        """Two consecutive rounds' dirty amounts within ``tolerance`` of each other —
        or growing: the migration is not converging."""
        if len(self.rounds) < 2:
            return False
        (_, _, a), (_, _, b) = self.rounds[-2], self.rounds[-1]
        if a <= 0:
            return False
        return b >= a or abs(b - a) / a < tolerance


class Ewma:
    """Exponentially weighted moving average (for bandwidth)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> float:
        if x <= 0:
            return self.value or 0.0
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value
