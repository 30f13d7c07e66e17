#!/usr/bin/env python3
"""Boot the guest image under QEMU, talk to the agent, and measure it.

Checks that hello / ready / hb / rate lines arrive, answers ping, and reports
boot-to-hello and boot-to-ready times, heartbeat regularity (host arrival times
and guest clock), and the achieved workload rates against the requested ones.

    guest/tools/bootcheck.py --workload mem:size=256M,rate=64M,hot=80/10 --seconds 10
    guest/tools/bootcheck.py --workload disk:bs=4K,rate=4M --disk 256M
    guest/tools/bootcheck.py --workload idle --net      # UDP echo over user networking
    guest/tools/bootcheck.py --workload verify:mem=64M --corrupt 5
        # guest RAM in a shared file; the host flips a byte in 5 stamped blocks and
        # expects a verify_error naming each block's guest-physical address

Exit status 0 when every check passed. --json prints the measurements as JSON.
Standard library only (it runs before the project's venv exists).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT_NAME = "org.livemig.agent0"
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", text.upper())
    if not m:
        raise ValueError(f"bad size {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def spec_rates(spec: str) -> dict[str, int | None]:
    """Requested mem/disk rates from a spec (None = item absent, 0 = flat out)."""
    out: dict[str, int | None] = {"mem": None, "disk": None}
    for item in spec.split("+"):
        kind, _, body = item.partition(":")
        if kind not in ("mem", "disk"):
            continue
        kv = dict(p.split("=", 1) for p in body.split(",") if "=" in p)
        rate = parse_size(kv.get("rate", "0" if kind == "mem" else "1M"))
        out[kind] = (out[kind] or 0) + rate
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def default_qemu() -> str:
    built = ROOT / "build/qemu/qemu-system-x86_64"
    if built.exists():
        return str(built)
    return shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"


def qemu_cmd(a: argparse.Namespace, work: Path) -> list[str]:
    append = f"console=ttyS0 livemig.workload={a.workload} {a.append}".strip()
    if a.net:
        append += " livemig.ip=10.0.2.15/24 livemig.gw=10.0.2.2"
    cmd = [
        a.qemu, "-accel", a.accel, "-m", a.memory, "-smp", str(a.smp), "-nodefaults",
        "-display", "none", "-serial", f"file:{work}/console.log",
        "-kernel", str(a.kernel), "-initrd", str(a.initrd), "-append", append,
        "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
        "-device", "virtio-serial-pci,id=vser0",
        "-chardev", f"socket,id=agentch,path={work}/agent.sock,server=on,wait=off",
        "-device", f"virtserialport,bus=vser0.0,chardev=agentch,name={PORT_NAME}",
    ]
    if a.corrupt:
        cmd += ["-object", f"memory-backend-file,id=ram0,size={a.memory},"
                f"mem-path={work}/guest.ram,share=on", "-machine", "memory-backend=ram0"]
    if a.disk:
        img = work / "disk.img"
        with open(img, "wb") as f:
            f.truncate(parse_size(a.disk))
        cmd += ["-drive", f"file={img},if=virtio,format=raw,cache=none,aio=threads"]
    if a.net:
        cmd += ["-netdev", f"user,id=n0,hostfwd=udp:127.0.0.1:{a.net_port}-:7777",
                "-device", "virtio-net-pci,netdev=n0,romfile="]
    return cmd


class Agent:
    """The host end of the agent channel: lines with their arrival times."""

    def __init__(self, path: Path, t0: float, deadline: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:
            try:
                self.sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        self.sock.settimeout(0.05)
        self.t0 = t0
        self.buf = b""
        self.lines: list[tuple[float, dict]] = []

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def pump(self, until: float, stop_on: str | None = None) -> dict | None:
        """Read lines until monotonic time `until` (or an event named stop_on)."""
        while time.monotonic() < until:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError("agent channel closed")
            now = time.monotonic() - self.t0
            self.buf += data
            *complete, self.buf = self.buf.split(b"\n")
            for raw in complete:
                try:
                    msg = json.loads(raw)
                except ValueError:
                    print(f"unparsable line: {raw!r}", file=sys.stderr)
                    continue
                self.lines.append((now, msg))
                if stop_on and msg.get("ev") == stop_on:
                    return msg
        return None

    def events(self, ev: str) -> list[tuple[float, dict]]:
        return [(t, m) for t, m in self.lines if m.get("ev") == ev]


def measure(agent: Agent, requested: dict[str, int | None], t_ready: float) -> dict:
    res: dict = {}
    hbs = [(t, m) for t, m in agent.events("hb") if t > t_ready]
    if len(hbs) > 2:
        host = [(b[0] - a[0]) * 1e3 for a, b in itertools.pairwise(hbs)]
        guest = [(b[1]["t"] - a[1]["t"]) / 1e6 for a, b in itertools.pairwise(hbs)]
        seqs = [m["seq"] for _, m in hbs]
        res["hb"] = {
            "count": len(hbs), "missing_seq": seqs[-1] - seqs[0] + 1 - len(seqs),
            "guest_ms": {"p50": round(statistics.median(guest), 3),
                         "p99": round(pct(guest, 0.99), 3), "max": round(max(guest), 3)},
            "host_ms": {"p50": round(statistics.median(host), 3),
                        "p99": round(pct(host, 0.99), 3), "max": round(max(host), 3)},
        }
    rates = [(t, m) for t, m in agent.events("rate") if t > t_ready + 1.0]
    if len(rates) > 2:
        (_, a), (_, b) = rates[0], rates[-1]
        dt = (b["t"] - a["t"]) / 1e9
        res["rate"] = {"window_s": round(dt, 2)}
        for key, counter in (("mem", "mem_bytes"), ("disk", "disk_bytes")):
            achieved = (b[counter] - a[counter]) / dt
            res["rate"][key] = {"requested": requested[key], "achieved": round(achieved),
                                "achieved_mib_s": round(achieved / (1 << 20), 2)}
        res["rate"]["verify_blocks_s"] = round((b["verify_blocks"] - a["verify_blocks"]) / dt)
        res["rate"]["dropped_lines"] = b.get("dropped", 0)
        # smoothness: achieved rate per 100 ms report interval
        per = [((y["mem_bytes"] + y["disk_bytes"]) - (x["mem_bytes"] + x["disk_bytes"]))
               / ((y["t"] - x["t"]) / 1e9) / (1 << 20)
               for (_, x), (_, y) in itertools.pairwise(rates)]
        res["rate"]["per_report_mib_s"] = {"min": round(min(per), 2),
                                           "p50": round(statistics.median(per), 2),
                                           "max": round(max(per), 2)}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qemu", default=default_qemu())
    p.add_argument("--kernel", type=Path, default=ROOT / "build/guest/vmlinuz")
    p.add_argument("--initrd", type=Path, default=ROOT / "build/guest/initrd.img")
    p.add_argument("--accel", default="tcg")
    p.add_argument("--memory", default="1G")
    p.add_argument("--smp", type=int, default=1)
    p.add_argument("--workload", default="mem:size=256M,rate=64M,hot=80/10")
    p.add_argument("--append", default="", help="more kernel command line")
    p.add_argument("--disk", help="attach a raw virtio disk of this size (e.g. 256M)")
    p.add_argument("--net", action="store_true", help="user networking + UDP echo check")
    p.add_argument("--net-port", type=int, default=17777)
    p.add_argument("--corrupt", type=int, default=0, metavar="N",
                   help="flip a byte in N of the checker's memory blocks, expect reports")
    p.add_argument("--seconds", type=float, default=8.0, help="steady state to measure")
    p.add_argument("--boot-timeout", type=float, default=120.0)
    p.add_argument("--then", action="append", default=[],
                   help="a command to send after the measurement (e.g. 'workload idle')")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="livemig-bootcheck-"))
    cmd = qemu_cmd(a, work)
    failures: list[str] = []
    res: dict = {"workload": a.workload, "qemu": a.qemu, "cmd": cmd}
    agent: Agent | None = None
    t0 = time.monotonic()
    with open(work / "qemu.err", "w") as err:
        qemu = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        agent = Agent(work / "agent.sock", t0, t0 + 10)
        hello = agent.pump(t0 + a.boot_timeout, stop_on="hello")
        if not hello:
            raise TimeoutError("no hello")
        res["boot_to_hello_s"] = round(agent.lines[-1][0], 2)
        ready = agent.pump(t0 + a.boot_timeout, stop_on="ready")
        if not ready:
            raise TimeoutError("no ready")
        t_ready = agent.lines[-1][0]
        res["boot_to_ready_s"] = round(t_ready, 2)
        agent.send("ping tok-1")
        agent.pump(time.monotonic() + a.seconds)
        if not any(m.get("token") == "tok-1" for _, m in agent.events("pong")):
            failures.append("no pong")
        res.update(measure(agent, spec_rates(a.workload), t_ready))
        if a.corrupt:
            res["corrupt"] = corrupt(agent, work / "guest.ram", a.corrupt)
            if not res["corrupt"]["ok"]:
                failures.append("corruption not reported as expected")
        if a.net:
            res["udp_echo"] = udp_echo(a.net_port)
            if not res["udp_echo"]["ok"]:
                failures.append("udp echo")
        for c in a.then:
            agent.send(c)
            agent.pump(time.monotonic() + 3)
        res["errors"] = [m for _, m in agent.events("error")]
        res["verify_errors"] = [m for _, m in agent.events("verify_error")]
    except (TimeoutError, ConnectionError, OSError) as e:
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        qemu.terminate()
        qemu.wait(10)
    if agent is not None:
        with open(work / "agent.log", "w") as f:
            for t, m in agent.lines:
                f.write(f"{t:9.3f} {json.dumps(m)}\n")
    if "hb" not in res or res["hb"]["count"] < a.seconds * 50:
        failures.append("too few heartbeats")
    if "rate" not in res:
        failures.append("too few rate lines")
    if res.get("errors") or (res.get("verify_errors") and not a.corrupt):
        failures.append("agent reported errors")
    res["failures"] = failures
    if failures:
        tail = (work / "console.log").read_text(errors="replace")[-3000:]
        print(f"console tail:\n{tail}", file=sys.stderr)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            if k != "cmd":
                print(f"{k}: {v}")
    if not a.keep and not failures:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work dir: {work}", file=sys.stderr)
    return 1 if failures else 0


VBLOCK_MAGIC = struct.pack("<Q", 0x6C6D76626C6B3031)


def corrupt(agent: Agent, ram: Path, n: int) -> dict:
    """Flip one payload byte in n stamped blocks of guest RAM; wait for the reports."""
    with open(ram, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        blocks = [off for off in range(0, len(m), 4096) if m[off:off + 8] == VBLOCK_MAGIC]
        step = max(1, len(blocks) // n)
        hit = blocks[::step][:n]
        for off in hit:
            m[off + 1000] ^= 0x01
    t = time.monotonic()
    agent.pump(t + 10)
    got = [m for _, m in agent.events("verify_error")]
    addrs = {e["addr"] for e in got}
    return {"stamped_blocks_in_ram": len(blocks), "corrupted_gpa": hit,
            "reported_gpa": sorted(addrs), "reports": len(got),
            "ok": bool(hit) and addrs <= set(hit) and len(addrs) >= max(1, len(hit) - 1)}


def udp_echo(port: int, n: int = 20) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    ok, rtts = 0, []
    for i in range(n):
        payload = os.urandom(16) + bytes([i]) * 1000
        t = time.monotonic()
        s.sendto(payload, ("127.0.0.1", port))
        try:
            data, _ = s.recvfrom(4096)
        except TimeoutError:
            continue
        if data == payload:
            ok += 1
            rtts.append((time.monotonic() - t) * 1e3)
    return {"sent": n, "echoed": ok, "ok": ok >= n // 2,
            "rtt_ms_p50": round(statistics.median(rtts), 2) if rtts else None}


if __name__ == "__main__":
    sys.exit(main())
