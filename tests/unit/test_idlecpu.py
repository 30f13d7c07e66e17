"""The host's idle CPUs between two readings (livemig.idlecpu), without a VM."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from livemig import idlecpu
from livemig.idlecpu import Counters

STAT = """cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 12345
"""


def _stat(tmp: Path, name: str, **ticks: int) -> Counters:
    p = tmp / name
    p.write_text(STAT.format(**ticks))
    got = idlecpu.proc_stat(str(p))
    assert got is not None
    return got


def test_proc_stat_idle_share_times_the_cpus(tmp_path: Path) -> None:
    a = _stat(tmp_path, "a", user=1000, system=200, idle=500, iowait=0)
    # 200 ticks: 150 busy, 40 idle, 10 iowait -> a quarter of 2 CPUs idle
    b = _stat(tmp_path, "b", user=1120, system=230, idle=540, iowait=10)
    assert a[2] == 2
    assert idlecpu.idle_cpus(a, b) == 0.5


def test_no_time_between_readings_is_not_known(tmp_path: Path) -> None:
    a = _stat(tmp_path, "a", user=1, system=1, idle=1, iowait=0)
    assert idlecpu.idle_cpus(a, a) is None
    assert idlecpu.proc_stat(str(tmp_path / "missing")) is None


def test_meter_waits_out_its_window_and_reads_twice() -> None:
    readings = iter([(0.0, 0.0, 4), (300.0, 400.0, 4)])
    calls: list[int] = []

    def read() -> Counters | None:
        calls.append(1)
        return next(readings)
    meter = idlecpu.IdleMeter(read, window=0.05)
    assert asyncio.run(meter.idle_cpus()) == 3.0
    assert len(calls) == 2


def test_a_failed_first_reading_gives_none() -> None:
    meter = idlecpu.IdleMeter(lambda: None, window=0.0)
    assert asyncio.run(meter.idle_cpus()) is None


def test_this_host_reads() -> None:
    got = asyncio.run(idlecpu.IdleMeter(idlecpu.proc_stat, window=0.05).idle_cpus())
    assert got is not None and 0.0 <= got <= (os.cpu_count() or 1)


def test_a_reading_may_ask_for_a_shorter_window_than_the_meters() -> None:
    """The deferred encoding's reading before ``migrate`` waits SHORT_WINDOW_S, not
    the meter's WINDOW_S (the user would wait for it)."""
    readings = iter([(0.0, 0.0, 2), (100.0, 200.0, 2)])
    meter = idlecpu.IdleMeter(lambda: next(readings), window=30.0)
    t0 = time.monotonic()
    assert asyncio.run(meter.idle_cpus(window=0.05)) == 1.0
    assert time.monotonic() - t0 < 5.0
    assert idlecpu.SHORT_WINDOW_S < idlecpu.WINDOW_S
