"""x-query-ram-digest time on a stopped 4 GiB guest: untouched RAM, then with 12.5 %
written (every 8th 2 MiB region), then all of it written."""
import json, os, re, socket, subprocess, sys, tempfile, time, statistics
sys.path.insert(0, "/work/main/docs/results/ram-digest-threads-2026-11-29")
from digest_threads import Qmp
qemu, gib = sys.argv[1], int(sys.argv[2])
d = tempfile.mkdtemp(); sock = os.path.join(d, "qmp")
p = subprocess.Popen([qemu, "-S", "-nodefaults", "-m", f"{gib}G", "-display", "none",
    "-machine", "pc,accel=tcg", "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
    "-qmp", f"unix:{sock},server=on,wait=off"])
def rss(): return int(open(f"/proc/{p.pid}/statm").read().split()[1]) * 4096 >> 20
try:
    q = Qmp(sock)
    hva = int(re.search(r"0x[0-9a-f]+$", str(q.cmd("human-monitor-command", **{"command-line": "gpa2hva 0"})).strip()).group(0), 16)
    size = (gib << 30) if gib <= 3 else (3 << 30)  # pc.ram below 4G
    def timeit(label, n=3):
        ts = []
        for _ in range(n):
            t = time.monotonic(); q.cmd("x-query-ram-digest", threads=2); ts.append(time.monotonic() - t)
        print(label, "rss MiB", rss(), "digest s", [round(x, 3) for x in ts], flush=True)
    print("fresh rss", rss())
    # a fresh QEMU: first digest faults the zero page in
    timeit("untouched")
    fd = os.open(f"/proc/{p.pid}/mem", os.O_RDWR)
    fill = os.urandom(2 << 20)
    for off in range(0, size, 16 << 20):
        os.pwrite(fd, fill, hva + off)
    timeit("1/8 written")
    for off in range(0, size, 2 << 20):
        os.pwrite(fd, fill, hva + off)
    timeit("all written")
finally:
    p.kill()
