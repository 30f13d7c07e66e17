"""Plain QEMUs for tests, started WITHOUT livemig's lab code, and a tiny QMP client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from conftest import INITRD, KERNEL, QEMU


def start_qemu(d: Path, name: str, workload: str, incoming: bool = False,
               paused: bool = False, memory: str = "256M", qemu: Path | None = None,
               mem_file: Path | None = None,
               extra: list[str] | None = None, machine_type: str = "q35",
               vcpus: int = 1) -> subprocess.Popen[bytes]:
    """A minimal QEMU command line: anonymous RAM (or ``mem_file``, shared), the lab's
    kernel/initrd, the guest agent's port on a socket the test can read (nobody else
    connects to it); ``extra`` arguments at the end."""
    machine = ["-machine", machine_type]
    if mem_file is not None:
        machine = ["-machine", f"{machine_type},memory-backend=ram0", "-object",
                   f"memory-backend-file,id=ram0,size={memory},mem-path={mem_file},share=on"]
    argv = [str(qemu or QEMU), "-L", "/usr/share/seabios", "-L", "/usr/share/qemu",
            "-nodefaults", "-no-user-config", "-display", "none", "-accel", "tcg",
            *machine, "-m", memory, "-smp", str(vcpus),
            "-kernel", str(KERNEL), "-initrd", str(INITRD),
            "-append", f"console=ttyS0 quiet livemig.workload={workload}",
            "-serial", f"file:{d / name}.console",
            "-qmp", f"unix:{d / name}.qmp,server=on,wait=off",
            "-device", "virtio-serial-pci,id=vser0",
            "-chardev", f"socket,id=agentch,path={d / name}.agent,server=on,wait=off",
            "-device", "virtserialport,bus=vser0.0,chardev=agentch,name=org.livemig.agent0"]
    if incoming:
        argv += ["-incoming", "defer"]
    if paused:
        argv += ["-S"]
    argv += extra or []
    log = open(d / f"{name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while not (d / f"{name}.qmp").exists():
        assert proc.poll() is None, (d / f"{name}.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def qmp(path: Path, command: str, timeout: float = 30.0, **args: Any) -> Any:
    """One QMP command on a fresh connection (QEMU serves one client at a time)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        f = s.makefile("rwb")

        def call(cmd: str, a: dict[str, Any]) -> Any:
            msg: dict[str, Any] = {"execute": cmd}
            if a:
                msg["arguments"] = a
            f.write(json.dumps(msg).encode() + b"\n")
            f.flush()
            while True:
                reply = json.loads(f.readline())
                if "return" in reply:
                    return reply["return"]
                if "error" in reply:
                    raise RuntimeError(f"{cmd}: {reply['error']}")

        json.loads(f.readline())  # greeting
        call("qmp_capabilities", {})
        return call(command, args)


def agent_lines(path: Path, seconds: float) -> list[dict[str, Any]]:
    """What the guest agent says during ``seconds`` (its port is a socket chardev)."""
    out: list[dict[str, Any]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.settimeout(0.2)
        buf = b""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        for line in buf.split(b"\n"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def guest_progress(path: Path, tries: int = 4, seconds: float = 2.0) -> int:
    """Bytes the guest's memory workload wrote while the agent was listened to; a few
    tries, as a loaded host may keep the guest's port quiet for a moment after a
    (re)connection."""
    for _ in range(tries):
        got = mem_progress(agent_lines(path, seconds))
        if got > 0:
            return got
    return 0


def mem_progress(lines: list[dict[str, Any]]) -> int:
    """Bytes the guest's memory workload wrote over the ``rate`` lines seen."""
    rates = [x["mem_bytes"] for x in lines if x.get("ev") == "rate"]
    return rates[-1] - rates[0] if len(rates) >= 2 else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def has_command(path: Path, name: str) -> bool:
    return any(c["name"] == name for c in qmp(path, "query-commands"))


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 90.0) -> str:
    """livemig's stderr until a line matches ``pattern`` (a regex)."""
    import re

    seen = ""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, seen):
        assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
        assert proc.stderr is not None
        seen += proc.stderr.readline()
    return seen


def throttle_left(path: Path) -> int:
    """The management throttle still set on a patched QEMU (0 on a stock one)."""
    if not has_command(path, "query-cpu-throttle"):
        return 0
    return int(qmp(path, "query-cpu-throttle").get("management-percent", 0))
