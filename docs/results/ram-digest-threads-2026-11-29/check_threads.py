"""x-ram-digest-check's cost in the pause with one and more threads: a stopped guest
whose RAM is full of incompressible data migrated over a unix socket with multifd
(CHANNELS channels: the check digests with that many threads on each side), both
QEMUs on this host. Reports each side's digest time from query-migrate.

Usage: python3 check_threads.py QEMU SIZE_GIB REPEATS CHANNELS,...  -> JSON on stdout
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digest_threads import Qmp  # noqa: E402


def qemu_args(qemu: str, gib: int, sock: str, *extra: str) -> list[str]:
    return [qemu, "-S", "-nodefaults", "-m", f"{gib}G", "-display", "none", "-machine", "pc,accel=tcg",
            "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
            "-qmp", f"unix:{sock},server=on,wait=off", *extra]


def one(qemu: str, gib: int, channels: int, fill: bytes) -> dict[str, int]:
    d = tempfile.mkdtemp()
    procs = [subprocess.Popen(qemu_args(qemu, gib, f"{d}/src")),
             subprocess.Popen(qemu_args(qemu, gib, f"{d}/dst", "-incoming", "defer"))]
    try:
        src, dst = Qmp(f"{d}/src"), Qmp(f"{d}/dst")
        hva = int(str(src.cmd("human-monitor-command",
                              **{"command-line": "gpa2hva 0"})).split()[-1], 16)
        fd = os.open(f"/proc/{procs[0].pid}/mem", os.O_RDWR)
        for off in range(0, gib << 30, len(fill)):
            os.pwrite(fd, fill, hva + off)
        os.close(fd)
        for q in (src, dst):
            q.cmd("migrate-set-capabilities",
                  capabilities=[{"capability": "multifd", "state": True}])
            q.cmd("migrate-set-parameters", **{"multifd-channels": channels})
        src.cmd("migrate-set-capabilities",
                capabilities=[{"capability": "x-ram-digest-check", "state": True}])
        uri = f"unix:{d}/mig"
        dst.cmd("migrate-incoming", uri=uri)
        src.cmd("migrate", uri=uri)
        while (st := src.cmd("query-migrate")).get("status") not in ("completed", "failed"):
            time.sleep(0.1)
        if st["status"] != "completed":
            raise RuntimeError(st)
        while (dinfo := dst.cmd("query-migrate")).get("status") != "completed":
            time.sleep(0.05)
        s, t = st["x-ram-digest-check"], dinfo["x-ram-digest-check"]
        return {"threads": s["threads"], "dst_threads": t["threads"],
                "source_us": s["source-time"], "destination_us": t["destination-time"],
                "downtime_ms": st.get("downtime")}
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def main() -> None:
    qemu, gib, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    counts = [int(x) for x in sys.argv[4].split(",")]
    fill = os.urandom(64 << 20)
    runs: dict[int, list[dict[str, int]]] = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            runs[n].append(one(qemu, gib, n, fill))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in
               ("source_us", "destination_us", "downtime_ms")} for n, rs in runs.items()}
    print(json.dumps({"qemu": qemu, "gib": gib, "repeats": repeats, "runs": runs,
                      "median": med}))


if __name__ == "__main__":
    main()
