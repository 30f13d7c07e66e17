"""Every process's CPU time, polled every 0.25 s while the bench ran (a set's CPU
split by process kind). Usage: python3 cpu_poll.py OUT.jsonl  (stop it with a signal)."""
import json
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def kind(pid: str) -> str | None:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return None
    c = b" ".join(cmd).decode(errors="replace")
    if "qemu-system" in c:  # libvirt starts a migration's destination with -incoming
        return "qemu-dst" if "-incoming" in c else "qemu-src"
    if "livemig" in c and "python" in c:
        if "evacuate.bench" in c:
            return "bench"
        if "guardian" in c:
            return "guardian"
        if "worker" in c or "migrate" in c:
            return "livemig-child"
        if "evacuate" in c:
            return "livemig-evacuate"
        return "livemig-other"
    if "libvirtd" in c or "virtqemud" in c:
        return "libvirtd"
    return "other"


def main() -> None:
    out, kinds = open(sys.argv[1], "a"), {}
    while True:
        t, snap = time.time(), {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                f = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            parts = f[f.rindex(")") + 2:].split()
            if d not in kinds:
                kinds[d] = kind(d)
            snap[d] = [kinds[d], (int(parts[11]) + int(parts[12])) / TICK]
        out.write(json.dumps({"t": t, "p": snap}) + "\n")
        out.flush()
        time.sleep(0.25)


if __name__ == "__main__":
    main()
