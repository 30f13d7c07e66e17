"""A guest receiving the client's TCP stream (the agent's sink) through a live migration
on the testbed: the connection lives in the guest's kernel and moves with it."""

from __future__ import annotations

import os

import pytest

from conftest import new_run_id, run_migrate
from livemig.testbed import vswitch

pytestmark = [pytest.mark.vm, pytest.mark.testbed]
# the run may queue for the shared testbed (LIVEMIG_TESTBED_WAIT) before it boots
QUEUE_TIMEOUT = 400 + float(os.environ.get("LIVEMIG_TESTBED_WAIT", "0") or 0)


@pytest.mark.parametrize("net", ["tap", "vhost-user,queues=2"])
def test_tcp_stream_survives_migration(tmp_path, net):
    if net != "tap" and (why := vswitch.missing()) is not None:
        if os.environ.get("CI"):  # CI installs it (.ci/deps.sh): missing is a failure
            pytest.fail(why)
        pytest.skip(f"vhost-user switch not installed: {why}")
    r = run_migrate(tmp_path, "--net", net, "--vcpus", "1" if net == "tap" else "2",
                    "--memory", "512M", "--workload", "mem:size=64M,rate=16M",
                    "--link", "1gbit", "--set", "client-stream=tcp", "--max-time", "150",
                    "--run-id", new_run_id(), timeout=QUEUE_TIMEOUT)
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["outcome"] == "completed"
    assert rep["settings"]["net"] == net
    # the sink's receive buffers were written during the copy: RAM still identical
    assert rep["consistency"]["ram"] == "ok"
    st = rep["network"]["stream"]
    assert st["kind"] == "tcp", st
    # no reset or error on the client's side, none on the guest's
    assert st["connection"] == "survived" and st["error"] is None, st
    assert st["before_migration_bps"] > 0 and st["during_migration_bps"] is not None, st
    # bytes flowed after the switchover, as the client saw them (acked) and as the
    # destination's guest counted them
    assert st["bytes_acked_after_switchover"] > 0, st
    assert st["after_switchover_bps"] > 0, st
    assert st["guest_bytes_after_switchover"] > 0, st
    assert st["guest_connections"] == 1, st
    # the client closed in order: the guest saw an end of file, not a reset, after
    # receiving exactly what the client's stack says it acked
    assert st["drained"], st
    assert [c["how"] for c in st["guest_close"]] == ["eof"], st
    assert st["guest_close"][0]["bytes"] == st["bytes_sent"] == st["acked_at_close"], st
    # TCP's view of the pause: a stall around the switchover, bounded
    assert st["longest_stall_raw_ms"] is not None, st
    assert 0 <= st["longest_stall_ms"] < 10000, st
    assert rep["network"]["after_switchover"]["answered_by"] == "destination"
    if net != "tap":  # the switch logged its writes into guest RAM while migrating
        assert rep["network"]["vhost_user"]["log_enabled_seen"], rep["network"]
