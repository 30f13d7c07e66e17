"""A guest on vhost-user networking (Open vSwitch + DPDK on each testbed host, 2 queue
pairs) migrated while the client streams datagrams to it."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import new_run_id, run_migrate
from livemig.testbed import netns, topology, vswitch

pytestmark = [pytest.mark.vm, pytest.mark.testbed]
# the run may queue for the shared testbed (LIVEMIG_TESTBED_WAIT) before it boots
QUEUE_TIMEOUT = 400 + float(os.environ.get("LIVEMIG_TESTBED_WAIT", "0") or 0)


@pytest.fixture(autouse=True)
def _switch_installed():
    why = vswitch.missing()
    if why is None:
        return
    if os.environ.get("CI"):  # CI installs it (.ci/deps.sh): missing is a failure there
        pytest.fail(why)
    pytest.skip(f"vhost-user switch not installed: {why}")


def _switch_processes(run_id: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", f"/{run_id}/ovs-"], capture_output=True, text=True)
    return out.stdout.split("\n") if out.stdout.strip() else []


def _switch_links() -> list[str]:
    """The switch's devices left in the testbed's hosts (none once a run ended)."""
    left = []
    for host in ("src", "dst"):
        ns = topology.HOSTS[host]
        if netns.exists(ns):
            out = netns.run("ip", "-br", "link", ns=ns, check=False)
            left += [f"{host}:{ln.split()[0]}" for ln in out.splitlines()
                     if ln.split() and ln.split()[0].split("@")[0] in
                     (vswitch.UPLINK, vswitch.UPLINK_PEER, vswitch.BRIDGE,
                      vswitch.NETDEV_TAP)]
    return left


def test_vhost_user_two_queues_migrates_with_stream(tmp_path):
    run_id = new_run_id()
    r = run_migrate(tmp_path, "--net", "vhost-user,queues=2", "--vcpus", "2",
                    "--memory", "512M", "--workload", "mem:size=64M,rate=16M",
                    "--set", "client-stream=on", "--max-time", "150", "--run-id", run_id,
                    timeout=QUEUE_TIMEOUT)
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["outcome"] == "completed"
    assert rep["settings"]["net"] == "vhost-user,queues=2"
    # the switch's writes into guest RAM were logged and migrated: RAM identical
    assert rep["consistency"]["ram"] == "ok"
    net = rep["network"]
    vu = net["vhost_user"]
    assert vu["src"]["log_shmfd"] and vu["src"]["log_all"] and vu["src"]["mq"], vu
    assert vu["log_enabled_seen"], "QEMU never turned the vhost-user dirty log on"
    assert vu["dst"]["log_shmfd"], vu
    # the guest received the stream before and during the migration
    st = net["stream"]
    assert st["echoed"] > 1000 and st["before_migration_bps"] > 0, st
    assert st["during_migration_bps"] is not None and st["during_migration_bps"] > 0, st
    # both queue pairs exist on the switch's port (the guest has 2 vCPUs)
    assert {"rx_q0", "rx_q1", "tx_q0", "tx_q1"} <= set(vu["src_queue_packets"]), vu
    # after the switchover the replies come through the destination's switch only
    after = net["after_switchover"]
    assert after["answered_by"] == "destination", after
    assert after["packets_from_guest_on_src_port"] == 0, after
    assert rep["network_pause_ms"] is not None and rep["network_pause_ms"] < 5000
    # no switch process or device outlives the run
    assert _switch_processes(run_id) == []
    assert _switch_links() == []


def test_vhost_user_switches_stopped_after_abort(tmp_path):
    run_id = new_run_id()
    r = run_migrate(tmp_path, "--net", "vhost-user", "--memory", "512M",
                    "--workload", "mem:size=128M,rate=400M", "--bandwidth", "1M",
                    "--profile", "upstream-plain", "--max-time", "3", "--run-id", run_id,
                    timeout=QUEUE_TIMEOUT)
    assert r.rc == 3, r.report.get("reason")
    assert r.report["outcome"] == "aborted"
    assert r.report["source_after"]["workload_rate"] > 0
    assert _switch_processes(run_id) == []
    assert _switch_links() == []
