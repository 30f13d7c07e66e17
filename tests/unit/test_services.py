"""The service load generators' output parsers and the service workload specs (no VM)."""

import json

import pytest

from livemig.errors import UsageError
from livemig.services import pgbench, redisload
from livemig.services.client import ClientSeries
from livemig.spec import parse_workload


def test_pgbench_progress_and_errors():
    s = ClientSeries()
    lines = [
        "progress: 7.0 s, 91.0 tps, lat 40.599 ms stddev 15.140, 0 failed",
        "progress: 8.0 s, 0.0 tps, lat NaN ms stddev NaN, 0 failed",
        "progress: 9.0 s, 31.0 tps, lat 128.038 ms stddev 21.600, 2 failed",
        "pgbench: error: client 3 aborted in command 4 (SQL) of script 0; perhaps the "
        "backend died while processing",
        "some banner line",
    ]
    for k, line in enumerate(lines):
        pgbench.parse_line(line, 100.0 + k, s)
    assert [t.ops for t in s.ticks] == [91.0, 0.0, 31.0]
    assert s.ticks[1].latency_ms is None and s.ticks[2].failed == 2
    assert s.errors == 2 and s.disconnects == 1 and "aborted" in s.messages[0]
    cum = s.cumulative()
    assert cum[0] == (99.0, 0.0) and cum[-1] == (102.0, 122.0)


def test_redisload_lines():
    s = ClientSeries()
    redisload.parse_line(json.dumps({"t": 1, "ops": 4000, "errors": 0, "disconnects": 0,
                                     "lat_ms": 1.2}), 10.0, s)
    redisload.parse_line(json.dumps({"error": "connection: reset"}), 10.5, s)
    redisload.parse_line(json.dumps({"t": 2, "ops": 10, "errors": 1, "disconnects": 1,
                                     "lat_ms": None}), 11.0, s)
    redisload.parse_line(json.dumps({"check": {"keys": 5, "bad": 0, "missing": 1}}), 12.0, s)
    assert [t.ops for t in s.ticks] == [4000.0, 10.0]
    assert s.errors == 1 and s.disconnects == 1 and s.messages == ["connection: reset"]
    assert s.check == {"keys": 5, "bad": 0, "missing": 1}


def test_redis_values_are_deterministic_and_mixed():
    a = redisload.value_for("k", 7, 0, 1024)
    assert a == redisload.value_for("k", 7, 0, 1024) and len(a) == 1024
    assert a != redisload.value_for("k", 8, 0, 1024)
    assert a != redisload.value_for("k", 7, 1, 1024)
    assert a[:8].isascii() and len(set(a[512:])) > 100  # text half, random half


def test_service_specs():
    w = parse_workload("pgbench:scale=10,clients=8")
    assert w.service is not None and w.service.image == "postgres"
    assert w.service.image_params == ("scale=10",) and not w.is_idle
    r = parse_workload("redis:keys=1000,clients=2,value=512,reads=90").service
    assert r is not None and (r.keys, r.clients, r.value, r.reads) == (1000, 2, 512, 90)
    for bad in ("pgbench:scale=0", "redis:foo=1", "pgbench+idle", "redis:reads=101",
                "mem:size=1M+redis"):
        with pytest.raises(UsageError):
            parse_workload(bad)


def test_client_workload_figures():
    from livemig.services.client import Tick
    from livemig.services.figures import client_workload
    s = ClientSeries()
    # 100 tps for 10 s, 0 for 2 s (the switchover), 100 tps again
    for k in range(1, 11):
        s.ticks.append(Tick(float(k), 100.0, 10.0))
    s.ticks += [Tick(11.0, 0.0, None), Tick(12.0, 0.0, None)]
    for k in range(13, 18):
        s.ticks.append(Tick(float(k), 100.0, 10.0))
    wl = client_workload(s, "transactions", 1.0, 8.0, 17.0)
    assert abs(wl["baseline_rate"] - 100.0) < 1
    assert wl["unit"] == "transactions/s" and wl["client_errors"] == 0
    assert wl["longest_stall_s"] == 2.0
    assert 1.5 <= wl["work_lost_s"] <= 2.5
    assert 1.5 <= wl["seconds_below_10pct"] <= 2.5
    assert wl["per_second"][0]["rate"] == 100.0


def test_the_verification_hold_is_not_a_stall():
    from livemig.services.client import Tick
    from livemig.services.figures import client_workload
    s = ClientSeries()
    for k in range(1, 11):
        s.ticks.append(Tick(float(k), 100.0, 10.0))
    s.ticks += [Tick(11.0, 0.0, None), Tick(12.0, 0.0, None), Tick(13.0, 0.0, None)]
    for k in range(14, 18):
        s.ticks.append(Tick(float(k), 100.0, 10.0))
    wl = client_workload(s, "transactions", 1.0, 8.0, 17.0, exclude=(11.5, 13.0))
    assert wl["longest_stall_s"] == 1.0  # only the second before the hold
    assert sum(1 for p in wl["per_second"] if p.get("held_for_verification")) == 2
