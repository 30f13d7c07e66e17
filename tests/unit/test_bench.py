import subprocess
import sys
from pathlib import Path

import pytest

from livemig.bench import best_baseline, load_scenario, markdown, summarize
from livemig.errors import UsageError, VMError

ROOT = Path(__file__).resolve().parents[2]


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


def test_first_pass_is_where_round_two_begins():
    from livemig.bench import _first_pass
    rep = {**_rep("completed", 12.0), "timeline": [
        {"t": 0.5, "rounds": 1, "transferred": 10 << 20},
        {"t": 4.0, "rounds": 1, "transferred": 300 << 20},
        {"t": 4.25, "rounds": 2, "transferred": 310 << 20},
        {"t": 8.0, "rounds": 3, "transferred": 500 << 20}]}
    assert _first_pass(rep, "t") == 4.25 and _first_pass(rep, "transferred") == 310 << 20
    # done inside the first pass (an idle guest): the whole migration
    one = {**_rep("completed", 3.0, 80 << 20), "timeline": [{"t": 1.0, "rounds": 1}]}
    assert _first_pass(one, "t") == 3.0 and _first_pass(one, "transferred") == 80 << 20
    assert _first_pass({**_rep("aborted", 9.0), "timeline": []}, "t") is None
    row = summarize({"livemig": [rep]})["livemig"]
    assert row["first_pass_s"] == 4.25 and row["first_pass_mib"] == 310


def test_summarize_only_reads_the_reports_there(tmp_path):
    import asyncio
    import json

    from livemig.bench import run_bench
    sc = tmp_path / "s.toml"
    sc.write_text('name = "fam"\nworkload = "idle"\nmemory = "512M"\n'
                  'profiles = ["upstream", "livemig"]\nrepeats = 2\nstock_qemu = "same"\n')
    out = tmp_path / "out"
    out.mkdir()
    for p, t in (("upstream", 20.0), ("livemig", 8.0)):
        rep = {**_rep("completed", t), "timeline": []}
        (out / f"fam-{p}-1.json").write_text(json.dumps(rep))
    md = asyncio.run(run_bench([sc], out, "-", "", None, None, None, True, None, "only"))
    assert "| livemig |" in md and "1/1" in md and "(0.40×)" in md


def test_libvirt_bench_finds_the_agent_channel_libvirt_named():
    from livemig.libvirt_lab import channel_path

    xml = """<domain><devices>
      <channel type='unix'><source mode='bind' path='/run/x/org.qemu.guest_agent.0'/>
        <target type='virtio' name='org.qemu.guest_agent.0'/></channel>
      <channel type='unix'><source mode='bind' path='/var/lib/libvirt/qemu/ch/agent0'/>
        <target type='virtio' name='org.livemig.agent0'/></channel>
    </devices></domain>"""
    assert channel_path(xml) == "/var/lib/libvirt/qemu/ch/agent0"
    with pytest.raises(VMError, match="no livemig agent channel"):
        channel_path("<domain><devices/></domain>")


def test_bench_via_libvirt_refuses_a_local_family(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text('profiles = ["upstream"]\nrepeats = 1\nmemory = "256M"\n'
                  '[[family]]\nname = "f"\nworkload = "idle"\nlink = "local"\n')
    p = subprocess.run([sys.executable, "-m", "livemig.cli", "bench", "--via", "libvirt",
                        "--stock-qemu", "same", str(sc)], capture_output=True, text=True)
    assert p.returncode == 2 and "needs the testbed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
