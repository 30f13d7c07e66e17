"""The large-guest path: a 4 GiB TCG guest migrates with every page compared.

Sized for CI on a 2-core host: most of the 4 GiB is never touched by the guest (an
idle kernel and a small writer), so the migration is mostly QEMU scanning zero pages,
which is exactly the part that grows with RAM size. Loopback (``--link local``), so
the test does not queue behind other users of the testbed.
"""

from __future__ import annotations

import pytest

from conftest import new_run_id, qemu_pids, run_migrate

pytestmark = pytest.mark.vm
GIB = 1 << 30


def test_4g_guest_migrates_with_ram_verified(tmp_path):
    rid = new_run_id()
    r = run_migrate(tmp_path, "--memory", "4G", "--link", "local", "--profile", "livemig",
                    "--workload", "mem:size=64M,rate=16M,hot=80/10+verify:mem=32M",
                    "--qemu-trace", "bitmap", "--max-time", "240", "--run-id", rid,
                    timeout=420)
    rep = r.report
    assert r.rc == 0, rep.get("reason")
    assert rep["outcome"] == "completed"
    # every page of the 4 GiB compared, and the guest's own checker found nothing
    ram = rep["consistency"]["ram_detail"]
    assert rep["consistency"]["ram"] == "ok", ram
    assert ram["pages_compared"] == 4 * GIB // 4096
    assert rep["consistency"]["guest"] == "ok", rep["consistency"]["guest_errors"]
    # the destination ran the guest afterwards
    after = [e for e in rep["events"] if e["event"] == "destination after"]
    assert after and after[-1]["status"] == "running", after
    assert rep["settings"]["memory"] == 4 * GIB
    # QEMU's trace points reached the report: one bitmap sync per round at least
    # (the setup sync and the one in the final pause included), and the final pause
    # broken down
    tr = rep["qemu_trace"]
    assert tr["sync_count"] >= rep["rounds"] >= 1
    assert tr["final_sync_ms"] is not None and tr["final_sync_ms"] >= 0
    assert tr["first_byte_s"] is not None and 0 <= tr["first_byte_s"] < 30
    steps = tr["downtime_steps_ms"]
    assert steps["qemu_downtime"] is not None
    assert abs(steps["qemu_downtime"] - rep["downtime_ms"]) <= 5
    assert qemu_pids(rid) == []
