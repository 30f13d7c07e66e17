"""x-query-ram-digest with 1 and more threads on a stopped guest whose RAM is full
of incompressible data: wall time of the command (QMP round trip included), the
threads interleaved, and the digests checked equal across thread counts.

Usage: python3 digest_threads.py QEMU SIZE_GIB REPEATS THREADS,...  -> JSON on stdout
"""
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time


class Qmp:
    def __init__(self, path: str) -> None:
        for _ in range(200):
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                time.sleep(0.05)
        self.f = self.s.makefile("rwb")
        self.f.readline()
        self.cmd("qmp_capabilities")

    def cmd(self, name: str, **args: object) -> object:
        self.f.write(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "return" in r:
                return r["return"]
            if "error" in r:
                raise RuntimeError(r["error"])


def main() -> None:
    qemu, gib, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    counts = [int(x) for x in sys.argv[4].split(",")]
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "qmp")
    p = subprocess.Popen([qemu, "-S", "-nodefaults", "-m", f"{gib}G", "-display", "none",
                          "-machine", "pc,accel=tcg", "-L", "/usr/share/seabios",
                          "-L", "/usr/share/qemu",
                          "-qmp", f"unix:{sock},server=on,wait=off"])
    try:
        q = Qmp(sock)
        hva = int(re.search(r"0x[0-9a-f]+$", str(q.cmd(
            "human-monitor-command", **{"command-line": "gpa2hva 0"})).strip()).group(0), 16)
        block = next(b for b in q.cmd("x-query-ram-digest", **{"chunk-size": 1 << 30})["blocks"]
                     if b["name"] == "pc.ram")
        size = block["size"]
        fill = os.urandom(64 << 20)
        fd = os.open(f"/proc/{p.pid}/mem", os.O_RDWR)
        for off in range(0, size, len(fill)):
            os.pwrite(fd, fill[:min(len(fill), size - off)], hva + off)
        os.close(fd)
        times: dict[int, list[float]] = {n: [] for n in counts}
        digests: dict[int, object] = {}
        for _ in range(repeats):
            for n in counts:
                t0 = time.monotonic()
                r = q.cmd("x-query-ram-digest", threads=n)
                times[n].append(time.monotonic() - t0)
                digests[n] = r["blocks"]
        same = all(digests[n] == digests[counts[0]] for n in counts)
        print(json.dumps({"qemu": qemu, "ram_bytes": size, "repeats": repeats,
                          "digests_equal": same,
                          "seconds": {n: sorted(round(t, 4) for t in ts) for n, ts in times.items()},
                          "median_s": {n: round(statistics.median(ts), 4) for n, ts in times.items()},
                          "s_per_gib": {n: round(statistics.median(ts) / (size / 2**30), 4)
                                        for n, ts in times.items()}}))
    finally:
        p.terminate()
        p.wait()


if __name__ == "__main__":
    main()
