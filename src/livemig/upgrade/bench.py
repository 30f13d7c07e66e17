"""Compare ways to replace a guest's QEMU: ``python -m livemig.upgrade.bench``.

Each combination (mode x RAM size x load) runs ``livemig upgrade`` on a fresh lab
guest ``--repeats`` times; the table shows medians. Absolute times on the shared
2-core machines are noisy; compare the modes within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

LOADS = {"idle": "idle+verify:mem=32M",
         "busy": "mem:size=256M,rate=64M,hot=80/10+verify:mem=32M"}
FIELDS = ("guest_pause_ms", "network_pause_ms", "downtime_ms", "qemu_pause_ms")


def one(mode: str, size: str, load: str, from_qemu: str, to_qemu: str,
        link: str = "testbed") -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        rep = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "livemig.cli", "upgrade", "--quiet", "--accel", "tcg",
               "--from-qemu", from_qemu, "--to-qemu", to_qemu, "--mode", mode,
               "--memory", size, "--workload", LOADS[load], "--settle", "2",
               "--link", link, "--report", str(rep)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if not rep.exists():
            return {"outcome": "failed", "reason": p.stderr.strip()[-300:]}
        r = json.loads(rep.read_text())
    pb = r.get("pause_breakdown") or {}
    return {"outcome": r["outcome"], "reason": r.get("reason"),
            "guest_pause_ms": r.get("guest_pause_ms"),
            "network_pause_ms": r.get("network_pause_ms"),
            "downtime_ms": r.get("downtime_ms"), "qemu_pause_ms": pb.get("qemu_pause_ms"),
            "breakdown": {k: v for k, v in pb.items() if k.endswith("_ms")
                          and not isinstance(v, list)},
            "heartbeat_gaps_top": pb.get("heartbeat_gaps_top"),
            "total_time_s": r.get("total_time_s")}


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("outcome") == "completed" and r.get(key) is not None]
    return round(statistics.median(vals), 1) if vals else None


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| mode | RAM | load | ok | guest pause ms | network pause ms | QEMU downtime ms "
             "| QEMU stop->run ms |", "|---|---|---|---|---|---|---|---|"]
    for key, runs in results.items():
        mode, size, load = key.split("/")
        ok = sum(r.get("outcome") == "completed" for r in runs)
        cells = [str(median(runs, f)) for f in FIELDS]
        lines.append(f"| {mode} | {size} | {load} | {ok}/{len(runs)} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--modes", default="cpr-transfer,cpr-exec,migrate,save-restore")
    p.add_argument("--sizes", default="512M,1G,4G")
    p.add_argument("--loads", default="idle,busy")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--from-qemu", required=True)
    p.add_argument("--to-qemu", required=True)
    p.add_argument("--link", default="testbed", choices=["testbed", "local"],
                   help="local: no testbed (no client probes, no queueing for it)")
    p.add_argument("--out", type=Path, required=True, help="JSON with every run")
    a = p.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    if a.out.exists():
        results = json.loads(a.out.read_text())
    for size in a.sizes.split(","):
        for load in a.loads.split(","):
            for mode in a.modes.split(","):
                key = f"{mode}/{size}/{load}"
                runs = results.setdefault(key, [])
                while len(runs) < a.repeats:
                    runs.append(one(mode, size, load, a.from_qemu, a.to_qemu, a.link))
                    print(key, json.dumps(runs[-1]), flush=True)
                    a.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
