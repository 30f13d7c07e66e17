"""livemig soak without a VM: combinations, cycling, faults, ledger, resume, summary."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from livemig.errors import UsageError
from livemig.pingpong import Hop, tally
from livemig.settings import resolve
from livemig.soak import combos, ledger, summarize
from livemig.spec import parse_workload


# -- combinations -------------------------------------------------------------------------
def test_catalogue_covers_every_value_of_every_dimension():
    cs = list(combos.COMBOS.values())
    assert len(cs) >= 12
    assert {c.encoding for c in cs} == set(combos.ENCODINGS)
    assert {c.throttle for c in cs} == set(combos.THROTTLES)
    assert {c.load for c in cs} == set(combos.LOADS)
    assert {c.drain for c in cs} == {True, False}
    assert {c.defer for c in cs} == {True, False}
    assert {c.storage for c in cs} == {"shared", "copy"}
    assert len({c.link for c in cs}) >= 3  # 1 Gbit/s, 200 Mbit/s, unshaped


def test_every_combination_is_a_valid_plan_and_load():
    caps = {"return-path": True, "multifd": True, "xbzrle": True, "x-switchover-drain": True,
            "postcopy-ram": True}
    for c in combos.COMBOS.values():
        parse_workload(c.workload)  # the host's parser accepts every load
        comb = c.combination()
        r = resolve(comb.sets, caps, {"x-hot-page-defer-percent": "int"})
        assert r.livemig["encoding"] == c.encoding
        assert r.livemig["throttle"] == c.throttle
        assert (c.bandwidth is not None) == (c.throttle != "off" or c.defer
                                             or c.postcopy), c.name
        assert (r.livemig["postcopy-after"] > 0) == c.postcopy, c.name
        if c.postcopy:  # no verify hold to inject at: the checker verifies these
            assert c.fault_kind is None and r.capabilities["postcopy-ram"]


def test_loads_grouped_so_the_checker_restarts_once_per_load():
    loads = [c.load for c in combos.COMBOS.values()]
    changes = sum(a != b for a, b in itertools.pairwise(loads))
    assert changes == len(set(loads)) - 1


def test_hops_cycle_in_order_and_resume_where_they_left_off():
    names = ["checker-plain", "disk-copy", "idle-plain"]
    assert [combos.for_hop(names, n).name for n in range(1, 8)] == [
        "checker-plain", "disk-copy", "idle-plain", "checker-plain", "disk-copy",
        "idle-plain", "checker-plain"]


@pytest.mark.parametrize("spec", ["nope", "checker-plain,nope", ",", ""])
def test_unknown_combinations_refused(spec):
    with pytest.raises(UsageError, match="unknown combination"):
        combos.select(spec)


def test_select_all_and_subset():
    assert combos.select(None) == list(combos.COMBOS)
    assert combos.select("all") == list(combos.COMBOS)
    assert combos.select("disk-copy, idle-plain") == ["disk-copy", "idle-plain"]


def test_fault_kinds_follow_the_checker():
    C = combos.COMBOS
    assert C["disk-copy"].fault_kind == "disk-stamped"
    assert C["checker-plain"].fault_kind == "ram-stamped"
    assert C["disk-xbzrle-unshaped"].fault_kind == "ram-stamped"  # shared disk: RAM only
    assert C["idle-plain"].fault_kind is None  # no checker: nothing could name it


def test_fault_due_every_n_hops_and_deferred_past_idle():
    C = combos.COMBOS
    assert combos.fault_due(None, 100, C["checker-plain"]) is None
    assert combos.fault_due(5, 3, C["checker-plain"]) is None
    assert combos.fault_due(5, 4, C["checker-plain"]) == "ram-stamped"
    assert combos.fault_due(5, 4, C["idle-plain"]) is None  # due, but it waits
    assert combos.fault_due(5, 6, C["disk-copy"]) == "disk-stamped"
    assert combos.fault_due(1, 0, C["checker-plain"]) == "ram-stamped"


# -- tally and ledger lines ----------------------------------------------------------------
def _hop(index: int = 1, *, ram: str = "ok", injected: list[dict[str, Any]] | None = None,
         first: list[str] | None = None, n_ram: int = 0, outcome: str = "completed",
         lost: bool = False) -> Hop:
    h = Hop(index, "checker-plain", "src", "dst", guest_lost=lost, wall_s=9.5)
    h.report = {"outcome": outcome, "reason": None, "total_time_s": 2.5,
                "downtime_ms": 35.0, "guest_pause_ms": 40.0, "network_pause_ms": 50.0,
                "consistency": {"ram": ram, "disk": "skipped", "guest": "ok",
                                "ram_detail": {"first_mismatches": first or [],
                                               "mismatched_pages": n_ram}}}
    h.injected = injected or []
    return h


FAULT = {"target": "ram", "block": "0x1234000", "t": 0.0}


def test_a_fault_named_by_host_and_guest_is_caught():
    h = _hop(ram="mismatch", injected=[FAULT], first=["0x1234000"], n_ram=1)
    tally(h, [{"kind": "mem", "addr": 0x1234000, "t": 1.0}])
    e = ledger.entry(h, combos.COMBOS["checker-plain"], "s1", "ram-stamped")
    assert e["fault"]["caught"] is True and e["mismatches"] == 0
    assert ledger.bad(e) == []


def test_a_fault_the_guest_missed_is_not_caught():
    """The negative case: a fault injected and not reported by the checker fails."""
    h = _hop(ram="mismatch", injected=[FAULT], first=["0x1234000"], n_ram=1)
    tally(h, [])
    e = ledger.entry(h, combos.COMBOS["checker-plain"], "s1", "ram-stamped")
    assert e["fault"]["caught"] is False
    assert "not caught" in ledger.bad(e)[0]


def test_a_fault_the_host_missed_is_not_caught():
    h = _hop(injected=[FAULT])
    tally(h, [{"kind": "mem", "addr": 0x1234000, "t": 1.0}])
    e = ledger.entry(h, combos.COMBOS["checker-plain"], "s1", "ram-stamped")
    assert e["fault"]["caught"] is False and ledger.bad(e)


def test_a_fault_due_but_never_injected_is_not_caught():
    h = _hop()
    tally(h, [])
    e = ledger.entry(h, combos.COMBOS["checker-plain"], "s1", "ram-stamped")
    assert e["fault"]["injected"] == 0 and not e["fault"]["caught"]


def test_mismatch_beyond_the_fault_is_unexplained():
    h = _hop(ram="mismatch", injected=[FAULT], first=["0x1234000", "0x9000"], n_ram=2)
    tally(h, [{"kind": "mem", "addr": 0x1234000, "t": 1.0},
              {"kind": "mem", "addr": 0x5000, "t": 1.0}])
    assert h.unexplained == 2  # one more page for the host, one more for the guest
    e = ledger.entry(h, combos.COMBOS["checker-plain"], "s1", "ram-stamped")
    assert "2 unexplained mismatches" in ledger.bad(e)


def test_ledger_line_has_every_field():
    h = _hop(7)
    tally(h, [])
    e = ledger.entry(h, combos.COMBOS["disk-copy"], "sabc", None)
    assert e["hop"] == 7 and e["combination"] == "disk-copy" and e["run"] == "sabc"
    assert e["features"]["storage"] == "copy" and e["features"]["load"] == "disk-writes"
    assert (e["from"], e["to"]) == ("src", "dst")
    assert e["verdicts"] == {"ram": "ok", "disk": "skipped", "checker": "ok"}
    assert e["timings"] == {"total_s": 2.5, "downtime_ms": 35.0, "guest_pause_ms": 40.0,
                            "network_pause_ms": 50.0, "verify_hold_ms": None,
                            "hop_wall_s": 9.5}
    assert e["fault"] is None and e["guest_lost"] is False and e["time"].endswith("Z")
    json.dumps(e)


def test_lost_guest_and_failed_hop_are_bad():
    assert ledger.bad(ledger.entry(_hop(lost=True), combos.COMBOS["checker-plain"], "s",
                                   None)) == ["guest lost"]
    e = ledger.entry(_hop(outcome="failed"), combos.COMBOS["checker-plain"], "s", None)
    assert ledger.bad(e) and e["outcome"] == "failed"


# -- resume ----------------------------------------------------------------------------
def _write(path: Path, entries: list[dict[str, Any]], tail: bytes = b"") -> None:
    book = ledger.Ledger(path)
    for e in entries:
        book.append(e)
    with open(path, "ab") as f:
        f.write(tail)


def _entry(n: int, fault: bool = False, combo: str = "checker-plain") -> dict[str, Any]:
    h = _hop(n, injected=[FAULT] if fault else None, first=["0x1234000"] if fault else None,
             n_ram=1 if fault else 0, ram="mismatch" if fault else "ok")
    tally(h, [{"kind": "mem", "addr": 0x1234000, "t": 1.0}] if fault else [])
    e = ledger.entry(h, combos.COMBOS[combo], "s1", "ram-stamped" if fault else None)
    return e


def test_resume_continues_after_the_last_hop(tmp_path):
    p = tmp_path / "l.jsonl"
    _write(p, [_entry(1), _entry(2, fault=True), _entry(3), _entry(4)])
    st = ledger.state(ledger.read(p))
    assert st.last_hop == 4 and st.hops_since_fault == 2 and st.run == "s1"
    assert ledger.state([]).last_hop == 0


def test_resume_cuts_a_half_written_last_line(tmp_path):
    p = tmp_path / "l.jsonl"
    _write(p, [_entry(1), _entry(2)], tail=b'{"v": 1, "hop": 3, "comb')
    assert len(ledger.read(p)) == 2  # summarize: ignored, file untouched
    assert p.read_bytes().endswith(b'"comb')
    assert [e["hop"] for e in ledger.read(p, repair=True)] == [1, 2]
    assert p.read_bytes().endswith(b"}\n")  # the next append starts a clean line
    ledger.Ledger(p).append(_entry(3))
    assert [e["hop"] for e in ledger.read(p)] == [1, 2, 3]


def test_a_bad_line_inside_the_ledger_is_an_error(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text(json.dumps(_entry(1)) + "\nnot json\n" + json.dumps(_entry(2)) + "\n")
    with pytest.raises(UsageError, match="line 2 is not a hop record"):
        ledger.read(p)


def test_missing_ledger_is_empty(tmp_path):
    assert ledger.read(tmp_path / "none.jsonl") == []


# -- summarize -------------------------------------------------------------------------
def test_summary_per_combination(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [_entry(1), _entry(2, fault=True), _entry(3, combo="disk-copy")])
    _write(b, [_entry(4, combo="disk-copy")])
    s = summarize.summarize([a, b])
    assert s.clean
    assert set(s.rows) == {"checker-plain", "disk-copy"}
    r = s.rows["checker-plain"]
    assert (r.hops, r.ok, r.mismatches, r.lost, r.injected, r.caught) == (2, 2, 0, 0, 1, 1)
    assert s.total.hops == 4 and s.total.ok == 4
    out = summarize.report(s)
    assert "| checker-plain | 2 | 2 | 0 | 0 | 1/1 | 40 | 2.5 |" in out
    assert "4 hops over 2 combinations, 4 ok, 0 mismatches" in out and "PROBLEM" not in out


def test_summary_names_the_bad_hop(tmp_path):
    p = tmp_path / "l.jsonl"
    bad = _hop(2, injected=[FAULT])
    tally(bad, [])  # injected, nobody named it
    _write(p, [_entry(1), ledger.entry(bad, combos.COMBOS["checker-plain"], "s1",
                                       "ram-stamped")])
    s = summarize.summarize([p])
    assert not s.clean
    assert s.problems == ["l.jsonl hop 2 (checker-plain): injected ram-stamped not caught "
                          "(host named 0, checker 0 of 1)"]
    assert s.rows["checker-plain"].ok == 1


# -- the command line -------------------------------------------------------------------
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "livemig.cli", "soak", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_summary_since_a_hop_leaves_the_earlier_ones_out(tmp_path):
    p = tmp_path / "l.jsonl"
    bad = _hop(2, injected=[FAULT])
    tally(bad, [])  # a miss before a fix of the soak itself
    _write(p, [_entry(1), ledger.entry(bad, combos.COMBOS["checker-plain"], "s1",
                                       "ram-stamped"), _entry(3), _entry(4)])
    assert not summarize.summarize([p]).clean
    s = summarize.summarize([p], since=3)
    assert s.clean and s.total.hops == 2


def test_cli_summarize_exit_status(tmp_path):
    p = tmp_path / "l.jsonl"
    _write(p, [_entry(1), _entry(2, fault=True)])
    r = _cli("--summarize", str(p))
    assert r.returncode == 0 and "| checker-plain | 2 | 2 |" in r.stdout
    bad = _hop(3, lost=True)
    ledger.Ledger(p).append(ledger.entry(bad, combos.COMBOS["checker-plain"], "s1", None))
    r = _cli("--summarize", str(p))
    assert r.returncode == 4 and "PROBLEM l.jsonl hop 3 (checker-plain): guest lost" in r.stdout


def test_cli_lists_combinations():
    r = _cli("--combos", "list")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == len(combos.COMBOS)


@pytest.mark.parametrize("args", [
    ["--hops", "0"],
    ["--hops", "x"],
    ["--duration", "-5"],
    ["--duration", "nan"],
    ["--combos", "nope"],
    ["--inject-every", "0"],
    ["--memory", "128M"],
    ["--memory", "lots"],
    ["--max-time", "0"],
    ["--summarize", "/nonexistent/ledger.jsonl"],
    ["--bogus"],
])
def test_cli_bad_input_is_one_line_exit_2(args):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("livemig: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_cli_refuses_injection_without_env_and_on_idle_only():
    env = {k: v for k, v in __import__("os").environ.items()
           if k != "LIVEMIG_ALLOW_FAULT_INJECTION"}
    r = _cli("--inject-every", "3", env=env)
    assert r.returncode == 2 and "LIVEMIG_ALLOW_FAULT_INJECTION=1" in r.stderr
    r = _cli("--inject-every", "3", "--combos", "idle-plain",
             env={**env, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
    assert r.returncode == 2 and "guest checker" in r.stderr


def test_cli_refuses_an_existing_ledger_without_resume(tmp_path):
    p = tmp_path / "l.jsonl"
    _write(p, [_entry(1)])
    r = _cli("--ledger", str(p), "--hops", "1")
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    p.write_text("garbage\n" + json.dumps(_entry(2)) + "\n")
    r = _cli("--ledger", str(p), "--resume", "--hops", "1")
    assert r.returncode == 2 and "line 1 is not a hop record" in r.stderr


def test_boot_load_always_has_the_disk():
    C = combos.COMBOS
    assert combos.boot_load(C["idle-plain"]) == combos.CHECKER
    assert combos.boot_load(C["disk-copy"]) == C["disk-copy"].workload
    for c in C.values():
        w = parse_workload(combos.boot_load(c))
        assert w.verify is not None and w.verify.disk
