"""livemig soak --path libvirt without a VM: its catalogue, selection, plans, verdicts,
the child's command line, and the CLI's refusals."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest

from livemig import libvirt_lab
from livemig.errors import UsageError
from livemig.pingpong import Hop
from livemig.settings import merge
from livemig.soak import combos, ledger
from livemig.soak.libvirt_shuttle import LAB_ONLY_SETS, tally
from livemig.spec import parse_workload
from livemig.virt import plan as P

LV = combos.LIBVIRT_COMBOS
# the patched build's parameters and capabilities that the libvirt plans use
PATCHED = P.QemuInfo(
    frozenset({"xbzrle", "auto-converge", "events", "postcopy-ram", "multifd", "return-path",
               "pause-before-switchover", "x-switchover-drain", "x-ram-digest-check"}),
    {"multifd-channels": 2, "multifd-compression": "none", "multifd-zstd-level": 1,
     "downtime-limit": 300, "max-bandwidth": 0, "xbzrle-cache-size": 64 << 20,
     "cpu-throttle-initial": 20, "cpu-throttle-increment": 10, "tls-creds": "",
     "cpu-throttle-direct": 0, "cpu-throttle-lease-ms": 1000,
     "multifd-lz4-acceleration": 1, P.DELTA_KEY: 0},
    frozenset({"migrate", "set-cpu-throttle", "cancel-cpu-throttle"}))


def test_libvirt_catalogue_covers_what_the_issue_asks():
    cs = list(LV.values())
    assert all(c.name.startswith("libvirt-") and c.via == "libvirt" for c in cs)
    assert {c.encoding for c in cs} == set(combos.ENCODINGS)
    assert {c.storage for c in cs} == {"shared", "copy"}
    assert {c.load for c in cs} == set(combos.LOADS)
    converge = [c for c in cs if c.throttle == "converge"]
    assert converge and all(c.bandwidth == combos.THROTTLE_CAP for c in converge)
    assert [c.storage for c in cs[:2]] == ["shared", "copy"]  # two hops see both
    assert all(c.fault_kind is None for c in cs)  # no fault injection on libvirt hops


def test_libvirt_catalogue_keeps_each_load_together():
    loads = [c.load for c in LV.values()]
    assert sum(a != b for a, b in itertools.pairwise(loads)) == len(set(loads)) - 1


def test_the_two_catalogues_are_apart():
    assert not set(LV) & set(combos.COMBOS)
    assert combos.select(None) == list(combos.COMBOS)  # --path lab: unchanged
    assert combos.select(None, "libvirt") == list(LV)
    assert combos.select("libvirt-disk-copy, libvirt-idle-plain", "libvirt") == [
        "libvirt-disk-copy", "libvirt-idle-plain"]
    with pytest.raises(UsageError, match="other --path"):
        combos.select("libvirt-disk-copy", "lab")
    with pytest.raises(UsageError, match="other --path"):
        combos.select("disk-copy", "libvirt")
    with pytest.raises(UsageError, match="unknown combination nope"):
        combos.select("nope", "libvirt")
    assert combos.for_hop(["libvirt-checker-plain", "libvirt-disk-copy"], 4).name == \
        "libvirt-disk-copy"


@pytest.mark.parametrize("name", list(LV))
def test_every_libvirt_combination_is_a_libvirt_plan(name):
    """Each one's settings, cap and storage make a plan on the patched build, with the
    encoding it names really applied."""
    c = LV[name]
    parse_workload(c.workload)
    comb = c.combination()
    sets = {k: v for k, v in comb.sets.items() if k not in LAB_ONLY_SETS}
    p = P.make_plan(merge(comb.profile, sets), frozenset(sets), PATCHED,
                    P.Request(storage=comb.storage, bandwidth=comb.bandwidth,
                              unsafe=comb.storage == "shared"))
    flags = set(p.flag_names())
    if c.encoding == "xbzrle":
        assert "compressed" in flags and "parallel" not in flags
    else:
        assert "parallel" in flags
        want = {"plain": None, "zstd": "zstd", "lz4": "lz4", "lz4-delta": "lz4"}[c.encoding]
        assert p.src_qmp.get("multifd-compression") == want
        assert (P.DELTA_KEY in p.dst_globals) == (c.encoding == "lz4-delta")
    assert ("non_shared_disk" in flags) == (c.storage == "copy")
    assert ("unsafe" in flags) == (c.storage == "shared")
    assert p.ram_check  # the in-stream digest is the hop's RAM verdict
    if c.throttle == "converge":
        assert p.throttle == "converge" and P.P_BANDWIDTH in p.params


def test_migrate_argv_is_what_a_user_types():
    a = libvirt_lab.migrate_argv("dom", __import__("pathlib").Path("/tmp/r.json"),
                                 src="dst", dst="src", sets={"encoding": "zstd"},
                                 bandwidth=24 << 20, storage="shared", max_time=180)
    s = " ".join(a)
    assert "migrate --domain dom --connect qemu+tls://10.77.0.2/system" in s
    assert "--to qemu+tls://10.77.0.1/system" in s
    assert "--storage shared" in s and "--unsafe" in a and "--max-time 180" in s
    assert "--set encoding=zstd" in s and f"--bandwidth {24 << 20}" in s
    c = libvirt_lab.migrate_argv("dom", __import__("pathlib").Path("/r"), storage="copy")
    assert "--unsafe" not in c and "--storage copy" in " ".join(c)


def _hop(cons: dict, outcome: str = "completed", checker: bool = True) -> Hop:
    return Hop(1, "libvirt-checker-plain", "src", "dst",
               report={"outcome": outcome, "consistency": dict(cons)}, checker=checker)


def test_tally_checker_ok_only_when_it_ran_and_said_nothing():
    h = _hop({"ram": "ok", "disk": "skipped"})
    tally(h, [])
    assert h.as_dict()["guest"] == "ok" and h.unexplained == 0
    h = _hop({"ram": "ok"}, checker=False)
    tally(h, [])
    assert h.as_dict()["guest"] == "n/a"


def test_tally_counts_every_mismatch_as_unexplained():
    h = _hop({"ram": "ok", "disk": "mismatch"})
    tally(h, [{"ev": "verify_error", "kind": "mem", "addr": 4096, "t": 1.0}])
    assert h.unexplained == 2 and h.as_dict()["guest"] == "mismatch"
    h = _hop({"ram": "mismatch"}, outcome="failed")
    tally(h, [])
    assert h.unexplained == 1
    e = ledger.entry(h, LV["libvirt-checker-plain"], "l1", None)
    assert e["features"]["path"] == "libvirt" and e["fault"] is None
    assert "1 unexplained mismatches" in ledger.bad(e)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "livemig.cli", "soak", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_cli_lists_the_libvirt_catalogue():
    r = _cli("--path", "libvirt", "--combos", "list")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == len(LV)
    assert all(ln.startswith("libvirt-") for ln in r.stdout.splitlines())


@pytest.mark.parametrize("args,why", [
    (["--path", "libvirt", "--inject-every", "3"], "lab hops only"),
    (["--path", "libvirt", "--accel", "kvm"], "TCG"),
    (["--path", "libvirt", "--combos", "checker-plain"], "other --path"),
    (["--path", "virsh"], "invalid choice"),
])
def test_cli_libvirt_refusals_are_one_line_exit_2(args, why):
    r = _cli(*args, env={**os.environ, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
    assert r.returncode == 2 and why in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3
