#!/usr/bin/env python3
"""Guest NIC backends side by side: virtio-net via tap vs vhost-user (Open vSwitch +
DPDK) with 1 and 2 queue pairs, each migrated while the client streams to the guest.

    nice -n 19 python3 bench/vhost_user.py --repeats 3 --out reports/vhost-user-tcp
    nice -n 19 python3 bench/vhost_user.py --stream udp --out reports/vhost-user

Runs ``livemig migrate`` once per backend per repeat, interleaved (tap, 1q, 2q, tap,
...), same guest (2 vCPUs so that the guest's driver uses both queue pairs), same
light memory workload, the client's 10 ms probes and its stream to the guest
(``--stream``, i.e. ``--set client-stream=``): ``tcp`` (default) one TCP connection
to the agent's sink, flat out: acked throughput before, during and after the
migration and the longest stall; ``udp`` the UDP echo stream the first results were
measured with. Writes every report, a JSON summary and the Markdown table
(``table.md``, copied into docs/results/vhost-user.md by hand with the context).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NETS = ("tap", "vhost-user", "vhost-user,queues=2")
COMMON = ["--vcpus", "2", "--memory", "512M", "--workload", "mem:size=64M,rate=16M",
          "--link", "1gbit", "--set", "warmup=5", "-q"]


def run_one(livemig: str, net: str, report: Path, stream: str = "tcp") -> dict[str, Any]:
    argv = [livemig, "migrate", "--net", net, *COMMON, "--set", f"client-stream={stream}",
            "--report", str(report)]
    env = {**os.environ, "LIVEMIG_TESTBED_WAIT": os.environ.get("LIVEMIG_TESTBED_WAIT",
                                                                "1800")}
    t = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    if not report.exists():
        return {"net": net, "error": (p.stderr or p.stdout).strip()[-300:]}
    return summarize(net, json.loads(report.read_text()), p.returncode,
                     round(time.time() - t, 1))


def summarize(net: str, r: dict[str, Any], rc: int | None,
              wall: float | None) -> dict[str, Any]:
    n = r.get("network", {})
    st = n.get("stream", {})
    return {
        "net": net, "exit": rc, "wall_s": wall,
        "outcome": r.get("outcome"), "ram": r.get("consistency", {}).get("ram"),
        "answered_by": n.get("after_switchover", {}).get("answered_by"),
        "throughput_mbps": _mbps(st.get("before_migration_bps")),
        "during_migration_mbps": _mbps(st.get("during_migration_bps")),
        "network_pause_ms": r.get("network_pause_ms"), "probes_lost": n.get("probes_lost"),
        "guest_pause_ms": r.get("guest_pause_ms"), "verify_hold_ms": r.get("verify_hold_ms"),
        "downtime_ms": r.get("downtime_ms"), "total_time_s": r.get("total_time_s"),
        "dirty_log_seen": n.get("vhost_user", {}).get("log_enabled_seen"),
        "log_shmfd": n.get("vhost_user", {}).get("src", {}).get("log_shmfd"),
        "queue_packets": n.get("vhost_user", {}).get("src_queue_packets"),
        "port_drops": n.get("vhost_user", {}).get("src_port_drops"),
        "stream": st.get("kind"),
        # --stream tcp: acked payload (one direction), the stall, the connection
        "after_switchover_mbps": _mbps(st.get("after_switchover_bps")),
        "tcp_stall_ms": st.get("longest_stall_ms"),
        "tcp_stall_raw_ms": st.get("longest_stall_raw_ms"),
        "tcp_retransmits": st.get("retransmits"),
        "tcp_connection": st.get("connection"),
        "guest_bytes_after_switchover": st.get("guest_bytes_after_switchover"),
    }


def _mbps(bps: float | None) -> float | None:
    return None if bps is None else round(bps / 1e6, 1)


def table(rows: list[dict[str, Any]]) -> str:
    if any(r.get("stream") == "tcp" for r in rows):
        return tcp_table(rows)
    out = ["| net | run | outcome | RAM | answered by | stream Mbit/s (before) | "
           "stream Mbit/s (during migration) | network pause ms | probes lost | "
           "guest pause ms | QEMU downtime ms | total s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out += _run_rows(rows, 9, lambda r: (
        f"{r['outcome']} | {r['ram']} | {r['answered_by']} | {r['throughput_mbps']} | "
        f"{r['during_migration_mbps']} | {r['network_pause_ms']} | {r['probes_lost']} | "
        f"{r.get('guest_pause_ms')} | {r['downtime_ms']} | {r['total_time_s']} |"))
    out += ["", "| net | median stream Mbit/s | ratio to tap | median during migration | "
            "median network pause ms | ratio to tap | median guest pause ms |",
            "|---|---|---|---|---|---|---|"]
    med: dict[str, dict[str, float | None]] = {}
    for net in NETS:
        ok = [r for r in rows if r["net"] == net and "error" not in r]
        med[net] = {k: _median([r.get(k) for r in ok]) for k in
                    ("throughput_mbps", "during_migration_mbps", "network_pause_ms",
                     "guest_pause_ms")}
    base = med.get("tap", {})
    for net in NETS:
        m = med[net]
        out.append(f"| {net} | {m['throughput_mbps']} | "
                   f"{_ratio(m['throughput_mbps'], base.get('throughput_mbps'))} | "
                   f"{m['during_migration_mbps']} | {m['network_pause_ms']} | "
                   f"{_ratio(m['network_pause_ms'], base.get('network_pause_ms'))} | "
                   f"{m['guest_pause_ms']} |")
    return "\n".join(out) + "\n"


def tcp_table(rows: list[dict[str, Any]]) -> str:
    """Runs with the TCP stream: throughput is acked payload, client to guest."""
    out = ["| net | run | outcome | RAM | answered by | TCP Mbit/s before | during | "
           "after | TCP stall ms | stall raw ms | retransmits | connection | "
           "guest MiB after switchover | network pause ms | guest pause ms | "
           "QEMU downtime ms | total s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def cells(r: dict[str, Any]) -> str:
        gb = r.get("guest_bytes_after_switchover")
        return (f"{r['outcome']} | {r['ram']} | {r['answered_by']} | "
                f"{r['throughput_mbps']} | {r['during_migration_mbps']} | "
                f"{r.get('after_switchover_mbps')} | {r.get('tcp_stall_ms')} | "
                f"{r.get('tcp_stall_raw_ms')} | {r.get('tcp_retransmits')} | "
                f"{r.get('tcp_connection')} | "
                f"{None if gb is None else round(gb / 2**20, 1)} | "
                f"{r['network_pause_ms']} | {r.get('guest_pause_ms')} | "
                f"{r['downtime_ms']} | {r['total_time_s']} |")

    out += _run_rows(rows, 14, cells)
    keys = ("throughput_mbps", "during_migration_mbps", "after_switchover_mbps",
            "tcp_stall_ms", "network_pause_ms", "guest_pause_ms")
    med: dict[str, dict[str, float | None]] = {}
    for net in NETS:
        ok = [r for r in rows if r["net"] == net and "error" not in r]
        med[net] = {k: _median([r.get(k) for r in ok]) for k in keys}
        med[net]["n"] = len(ok)
    base = med.get("tap", {})
    out += ["", "| net | repeats | median TCP Mbit/s before | ratio to tap | during | "
            "ratio to tap | after | median TCP stall ms | ratio to tap | "
            "median network pause ms (UDP probes) | median guest pause ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for net in NETS:
        m = med[net]
        out.append(f"| {net} | {m['n']} | {m['throughput_mbps']} | "
                   f"{_ratio(m['throughput_mbps'], base.get('throughput_mbps'))} | "
                   f"{m['during_migration_mbps']} | "
                   f"{_ratio(m['during_migration_mbps'], base.get('during_migration_mbps'))}"
                   f" | {m['after_switchover_mbps']} | {m['tcp_stall_ms']} | "
                   f"{_ratio(m['tcp_stall_ms'], base.get('tcp_stall_ms'))} | "
                   f"{m['network_pause_ms']} | {m['guest_pause_ms']} |")
    return "\n".join(out) + "\n"


def _run_rows(rows: list[dict[str, Any]], empty: int,
              cells: Callable[[dict[str, Any]], str]) -> list[str]:
    """One table row per run, numbered per net; a failed run says its error."""
    out: list[str] = []
    runs: dict[str, int] = {}
    for r in rows:
        runs[r["net"]] = runs.get(r["net"], 0) + 1
        head = f"| {r['net']} | {runs[r['net']]} | "
        out.append(head + (f"error: {r['error']} |" + " |" * empty if "error" in r
                           else cells(r)))
    return out


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("reports/vhost-user-tcp"))
    ap.add_argument("--stream", choices=("tcp", "udp"), default="tcp",
                    help="the client's stream to the guest (--set client-stream=)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the reports already in --out instead of running again")
    ap.add_argument("--livemig", default=str(Path(sys.executable).parent / "livemig"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(a.repeats):
        for net in NETS:
            rep = a.out / f"{net.replace(',', '-').replace('=', '')}-{i + 1}.json"
            if rep.exists() and a.resume:
                rows.append(summarize(net, json.loads(rep.read_text()), None, None))
            else:
                rows.append(run_one(a.livemig, net, rep, a.stream))
            print(json.dumps(rows[-1]), flush=True)
            # written after every run: a long queue for the testbed loses nothing
            (a.out / "summary.json").write_text(json.dumps(rows, indent=1))
            (a.out / "table.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
