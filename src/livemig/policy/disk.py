"""Cross-storage policies: link sharing between disk and RAM, guest IO QoS, granularity.

``LinkShare`` (disk first). The disk's full copy runs before the RAM migration starts
(the orchestrator waits for the mirror to be READY), so RAM gets no share of the link
while it runs. After it, the mirror only has to keep up with what the guest writes:
it gets what its backlog and the observed re-dirtying need, ``backlog / DRAIN_S +
dirty_rate × HEADROOM``, at least ``MIN_DISK_SHARE`` and at most ``MAX_DISK_SHARE``
of the link; RAM gets the rest (``max-bandwidth``), a share that grows as the disk's
remainder shrinks. Together they fill the link instead of fighting over it.

``IoQos``. When the disk's dirty remainder has not shrunk over ``WINDOW_S`` (the mirror
has no rounds, so windows stand in for them; during the first pass too, which never
ends when the guest re-dirties the disk faster than the link copies it), cap the
guest's disk writes with ``block_set_io_throttle`` (only with a backlog above
``MIN_BACKLOG``; a smaller one the mirror clears in moments): first at ``FIRST_CAP``
of the observed write rate, then ``STEP`` lower per stalled window, never below
``FLOOR``. The cap is removed at the end of the migration (the executor does that on
completion, cancel and failure).

``choose_granularity``: the dirty-bitmap granularity that matches the guest's writes
(average write size seen in ``query-blockstats``, rounded up to a power of two, within
4 KiB .. 1 MiB): a granularity far above the write size makes the mirror re-send
mostly clean data (measured amplification 16× for 4 KiB writes at 64 KiB).
"""

from __future__ import annotations

from livemig.policy.base import Action, SetIoThrottle, SetMirrorSpeed, SetRamBandwidth, Snapshot

DRAIN_S = 2.0
HEADROOM = 1.5
MIN_DISK_SHARE = 0.05
MAX_DISK_SHARE = 0.5
CHANGE_THRESHOLD = 0.1  # do not re-issue a setting that moved less than this

WINDOW_S = 2.0
FIRST_CAP = 0.5
STEP = 0.5
FLOOR = 256 << 10
SHRINK_TOLERANCE = 0.05
MIN_BACKLOG = 8 << 20  # below this the mirror clears it in moments: no cap

MIN_GRANULARITY = 4 << 10
MAX_GRANULARITY = 1 << 20
DEFAULT_GRANULARITY = 64 << 10


class LinkShare:
    """Split a link of ``link_bytes``/s between the mirror and the RAM stream."""

    name = "disk-first"

    def __init__(self, link_bytes: float, ram_cap: int | None = None) -> None:
        self.link = link_bytes
        self.ram_cap = ram_cap  # an explicit --bandwidth is never exceeded
        self.disk_speed: int | None = None
        self.ram_bw: int | None = None

    def decide(self, s: Snapshot) -> list[Action]:
        if not s.disk_ready or s.disk_remaining is None:
            return []
        need = s.disk_remaining / DRAIN_S + (s.disk_dirty_rate or 0.0) * HEADROOM
        disk = int(min(MAX_DISK_SHARE * self.link, max(MIN_DISK_SHARE * self.link, need)))
        ram = int(self.link - disk)
        if self.ram_cap is not None:
            ram = min(ram, self.ram_cap)
        out: list[Action] = []
        if _changed(self.disk_speed, disk):
            self.disk_speed = disk
            out.append(SetMirrorSpeed(
                f"disk backlog {s.disk_remaining} B, re-dirtied {s.disk_dirty_rate or 0:.0f} "
                f"B/s: mirror gets {100 * disk / self.link:.0f}% of the link", disk))
        if _changed(self.ram_bw, ram):
            self.ram_bw = ram
            out.append(SetRamBandwidth(
                f"RAM gets the rest of the link: {100 * ram / self.link:.0f}%", ram))
        return out


def _changed(old: int | None, new: int) -> bool:
    return old is None or abs(new - old) > CHANGE_THRESHOLD * max(old, 1)


class IoQos:
    """Cap guest disk writes, step by step, while the disk remainder does not shrink."""

    name = "io-qos"

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.cap: int | None = None
        self._window_start: float | None = None
        self._remaining_at_start = 0

    def decide(self, s: Snapshot) -> list[Action]:
        if s.disk_remaining is None:  # no disk copy (the first pass counts too)
            return []
        if self._window_start is None:
            self._window_start, self._remaining_at_start = s.t, s.disk_remaining
            return []
        if s.t - self._window_start < self.window_s:
            return []
        before, now = self._remaining_at_start, s.disk_remaining
        self._window_start, self._remaining_at_start = s.t, now
        shrinking = now < before * (1 - SHRINK_TOLERANCE) or now <= MIN_BACKLOG
        if shrinking:
            return []
        if self.cap is None:
            rate = s.disk_write_rate or 0.0
            if rate <= FLOOR:
                return []
            cap = max(FLOOR, int(rate * FIRST_CAP))
        else:
            if self.cap <= FLOOR:
                return []
            cap = max(FLOOR, int(self.cap * STEP))
        self.cap = cap
        return [SetIoThrottle(f"disk remainder {before} -> {now} B in {self.window_s:g}s, "
                              f"not shrinking: cap guest writes at {cap} B/s", cap)]


def choose_granularity(wr_bytes: int, wr_ops: int) -> int:
    """Bitmap granularity for writes of the observed average size."""
    if wr_ops <= 0 or wr_bytes <= 0:
        return DEFAULT_GRANULARITY
    avg = wr_bytes / wr_ops
    g = MIN_GRANULARITY
    while g < avg and g < MAX_GRANULARITY:
        g *= 2
    return g
