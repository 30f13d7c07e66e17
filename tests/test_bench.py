from pathlib import Path

import pytest

from livemig.bench import best_baseline, load_scenario, markdown, summarize
from livemig.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _rep(outcome, t, sent=1 << 30):
    return {"outcome": outcome, "total_time_s": t, "ram_transferred_bytes": sent,
            "downtime_ms": 100, "guest_pause_ms": 150,
            "workload": {"seconds_below_10pct": 1.0, "work_lost_s": 0.5},
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
    assert "| livemig |  | 3/3 | 10 (0.40×) | 512 (0.50×)" in md


def test_shipped_scenarios_load():
    for path in (ROOT / "bench" / "scenarios").glob("*.toml"):
        sc = load_scenario(path)
        assert sc["profiles"]


def test_bad_scenario(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('memory = "1G"\nworkload = "mem:size=1Q"\n')
    with pytest.raises(UsageError):
        load_scenario(p)


def test_matrix_families_inherit_defaults():
    from livemig.bench import load_scenarios
    fams = load_scenarios(ROOT / "bench" / "scenarios" / "matrix.toml")
    names = [f["name"] for f in fams]
    assert len(names) == len(set(names)) >= 8
    for f in fams:
        assert f["repeats"] >= 3 and "upstream" in f["profiles"] and "livemig" in f["profiles"]
    links = {f["name"]: f["link"] for f in fams}
    assert links["hotset-small-100mbit"] == "100mbit"
    assert {f["storage"] for f in fams if "storage" in f} == {"copy"}


def test_matrix_bad_family(tmp_path):
    from livemig.bench import load_scenarios
    p = tmp_path / "m.toml"
    p.write_text('memory = "1G"\n[[family]]\nname = "a"\nworkload = "idle"\nlink = "9qbit"\n')
    with pytest.raises(UsageError, match="family a"):
        load_scenarios(p)


def test_stock_profiles_need_the_unpatched_binary(tmp_path):
    from livemig.bench import binaries
    sc = {"profiles": ["upstream", "livemig"]}
    with pytest.raises(UsageError, match="make qemu-upstream"):
        binaries(sc, tmp_path / "patched", tmp_path / "nope")
    same = binaries(sc, tmp_path / "patched", Path("same"))
    assert same == (tmp_path / "patched", tmp_path / "patched")
    # no stock profile: no stock binary needed
    assert binaries({"profiles": ["livemig"]}, tmp_path / "p", tmp_path / "nope")[0] == \
        tmp_path / "p"


def test_targets_and_binary_column():
    from livemig.bench import matrix_markdown, targets
    runs = {
        "upstream": [_rep("completed", 20)] * 3,
        "livemig": [_rep("completed", 10, 1 << 29)] * 3,
    }
    s = summarize(runs, {"upstream": "10.2.2 unpatched", "livemig": "10.2.2 patched"})
    lines = targets(s)
    assert any(t.startswith("total_time_s") and "met" in t for t in lines)
    assert any(t.startswith("ram_sent_mib") and "met" in t for t in lines)
    md = markdown("fam", "d", s)
    assert "| upstream | 10.2.2 unpatched | 3/3 |" in md
    assert "Targets for `livemig`" in md
    assert "| fam | upstream |" in matrix_markdown({"fam": s})
