"""``livemig upgrade``'s pure parts: the new command line, the trace, the breakdown."""

from __future__ import annotations

import pytest

from livemig.cli import main
from livemig.errors import UsageError
from livemig.upgrade import argv as av
from livemig.upgrade import timing
from livemig.upgrade.switch import _refusal

OLD = ["/old/qemu", "-name", "vm", "-machine", "q35,memory-backend=ram0",
       "-object", "memory-backend-file,id=ram0,size=512M,mem-path=/dev/shm/r,share=on",
       "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
       "-device", "virtio-net-pci,netdev=net0", "-S", "-daemonize", "-pidfile", "/run/p",
       "-incoming", "defer"]


def test_new_argv_swaps_binary_hands_over_the_tap_and_drops_one_process_options():
    new = av.new_argv(OLD, "/new/qemu", ["-incoming", "unix:/m"], {"net0": 7}, ["-D", "x"])
    assert new[0] == "/new/qemu"
    assert new[new.index("-netdev") + 1] == "tap,id=net0,fd=7"
    for gone in ("-S", "-daemonize", "-pidfile", "/run/p", "defer"):
        assert gone not in new
    assert new[-4:] == ["-incoming", "unix:/m", "-D", "x"]
    assert "memory-backend-file,id=ram0,size=512M,mem-path=/dev/shm/r,share=on" in new


def test_new_argv_needs_an_fd_for_every_tap():
    with pytest.raises(UsageError, match="net0"):
        av.new_argv(OLD, "/new/qemu", [], {})


def test_tap_netdevs_and_refused_spellings():
    taps = av.tap_netdevs(OLD)
    assert [(t.id, t.ifname, t.fd) for t in taps] == [("net0", "tap0", None)]
    assert av.tap_netdevs(["q", "-netdev", "user,id=n"]) == []
    assert av.tap_netdevs(["q", "--netdev", "tap,id=n,fd=5"])[0].fd == 5
    with pytest.raises(UsageError, match="-nic tap"):
        av.tap_netdevs(["q", "-nic", "tap,ifname=t"])
    with pytest.raises(UsageError, match="JSON"):
        av.tap_netdevs(["q", "-netdev", '{"type": "tap", "id": "n"}'])
    with pytest.raises(UsageError, match="multi-queue"):
        av.tap_netdevs(["q", "-netdev", "tap,id=n,queues=4"])


def test_split_and_join_keep_escaped_commas():
    opts = av.split_opts("file,id=a,,b,x=1")
    assert opts == [("file", None), ("id", "a,b"), ("x", "1")]
    assert av.join_opts(opts) == "file,id=a,,b,x=1"


def test_refusal_names_the_cause():
    reasons = ["Memory region pc.ram is not compatible with CPR. share=on is required."]
    assert _refusal(reasons, ["q", "-m", "1G"]).startswith("guest RAM is anonymous (plain -m)")
    assert "aux-ram-share" in _refusal(reasons, OLD)
    assert "(+1 more)" in _refusal(reasons * 2, OLD)


def test_trace_and_events_fold_into_a_breakdown():
    text = ("2026-11-23T10:30:52.100000Z cpr_state_load cpr-transfer mode\n"
            "garbage line\n"
            "2026-11-23T10:30:52.150000Z vm_state_notify running 0 reason 1 (x)\n"
            "2026-11-23T10:30:52.200000Z process_incoming_migration_co_end ret=0\n"
            "2026-11-23T10:30:52.201000Z vm_state_notify running 1 reason 9 (running)\n")
    new = timing.parse_trace(text)
    base = new["cpr_state_load"]
    assert round(new["running"] - base, 6) == 0.101
    old = timing.event_times([
        {"event": "STOP", "timestamp": {"seconds": int(base), "microseconds": 0}},
        {"event": "MIGRATION", "data": {"status": "completed"},
         "timestamp": {"seconds": int(base), "microseconds": 0}}])
    old = {k: v + (base - int(base)) + 0.09 for k, v in old.items()}  # stop at +90 ms
    b = timing.breakdown(base, old, new, base - 0.5)
    assert b.stop_ms == 90.0
    assert b.state_ms == 0.0
    assert b.load_ms == 10.0
    assert b.resume_ms == 1.0
    assert b.paused_ms == 11.0
    assert b.new_started_s == 0.5
    assert timing.breakdown(base, {}, {}).as_dict()["qemu_pause_ms"] is None
    lost = timing.breakdown(base - 0.05, {}, new).as_dict()  # STOP lost at exec
    assert lost["stop_event_seen"] is False and lost["qemu_pause_ms"] == 151.0


@pytest.mark.parametrize(("args", "message"), [
    (["--qmp", "/nonexistent.qmp"], "--qmp /nonexistent.qmp: no such file"),
    ([], "give either --qmp PATH"),
    (["--qmp", "/etc/hostname", "--memory", "1G"], "only for lab runs"),
])
def test_upgrade_cli_bad_input_is_one_line_exit_2(args, message, capsys, tmp_path):
    qemu = tmp_path / "qemu"
    qemu.write_text("")
    assert main(["upgrade", "--to-qemu", str(qemu), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
