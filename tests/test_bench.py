from pathlib import Path

import pytest

from livemig.bench import best_baseline, load_scenario, markdown, summarize
from livemig.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _rep(outcome, t, sent=1 << 30):
    return {"outcome": outcome, "total_time_s": t, "ram_transferred_bytes": sent,
            "downtime_ms": 100, "guest_pause_ms": 150,
            "workload": {"seconds_below_10pct": 1.0},
            "cpu_seconds": {"source": 10.0, "source_migration_threads": 2.0},
            "consistency": {"ram": "ok"}}


def test_summary_medians_and_baseline():
    runs = {
        "upstream": [_rep("completed", 30), _rep("completed", 20), _rep("aborted", 99)],
        "upstream-plain": [_rep("aborted", 99)] * 3,
        "livemig": [_rep("completed", 10, 1 << 29)] * 3,
    }
    s = summarize(runs)
    assert s["upstream"]["completed"] == 2 and s["upstream"]["total_time_s"] == 25
    assert s["upstream-plain"]["total_time_s"] is None
    assert best_baseline(s) == "upstream"
    md = markdown("x", "desc", s)
    assert "| livemig | 3/3 | 10 (0.40×) | 512 (0.50×)" in md


def test_shipped_scenarios_load():
    for path in (ROOT / "bench" / "scenarios").glob("*.toml"):
        sc = load_scenario(path)
        assert sc["profiles"]


def test_bad_scenario(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('memory = "1G"\nworkload = "mem:size=1Q"\n')
    with pytest.raises(UsageError):
        load_scenario(p)
