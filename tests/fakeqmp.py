"""A scripted QEMU end for unit tests of the engine's pure paths (no process)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from livemig.errors import VMError

PAGE = 4096


class FakeEnd:
    """Answers the QMP commands the engine uses from a little state machine.

    ``statuses``: what successive ``query-migrate`` calls report once ``migrate`` was
    issued (the last one repeats); ``ram``: block name -> bytes, for the digest."""

    def __init__(self, name: str, *, status: str = "running",
                 statuses: list[str] | None = None, ram: dict[str, bytearray] | None = None,
                 commands: set[str] | None = None) -> None:
        self.name = name
        self.status = status
        self.caps: dict[str, bool] = {"events": False, "multifd": False,
                                      "auto-converge": False, "xbzrle": False}
        self.params: dict[str, Any] = {"max-bandwidth": 134217728, "downtime-limit": 300,
                                       "multifd-channels": 2}
        self.statuses = list(statuses or ["active", "completed"])
        self.migrating = False
        self.ram = ram or {}
        self.commands = commands or set()
        self.log: list[tuple[str, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.dead = False
        self.ram_file: Path | None = None
        self.pid: int | None = None
        self.autostart = True
        self.vcpus = 1
        self.digest_threads = True  # x-query-ram-digest takes 'threads' (patch 0017)

    def alive(self) -> bool:
        return not self.dead

    async def has_command(self, command: str) -> bool:
        return command in self.commands

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        return self.events.pop(0) if self.events else None

    def called(self, command: str) -> list[dict[str, Any]]:
        return [a for c, a in self.log if c == command]

    async def cmd(self, command: str, **args: Any) -> Any:
        self.log.append((command, args))
        if command == "query-migrate-capabilities":
            return [{"capability": k, "state": v} for k, v in self.caps.items()]
        if command == "query-migrate-parameters":
            return dict(self.params)
        if command == "migrate-set-capabilities":
            if self.migrating:
                raise VMError(f"{self.name}: migration active")
            for c in args["capabilities"]:
                self.caps[c["capability"]] = c["state"]
            return {}
        if command == "migrate-set-parameters":
            unknown = set(args) - set(self.params)
            if unknown:
                raise VMError(f"{self.name}: unknown parameter {unknown}")
            self.params.update(args)
            return {}
        if command == "migrate-incoming":
            self.status = "inmigrate"
            return {}
        if command == "migrate":
            self.migrating = True
            return {}
        if command == "migrate_cancel":
            self.statuses = ["cancelling", "cancelled"]
            return {}
        if command == "query-migrate":
            if not self.migrating:
                return {}
            st = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
            if st in ("completed", "cancelled", "failed"):
                self.migrating = False
                self.statuses = [st]
                if st == "completed":
                    self.status = "postmigrate"
            return {"status": st, "ram": {"transferred": 1 << 20, "remaining": 1 << 20,
                                          "total": 256 << 20, "dirty-sync-count": 1,
                                          "mbps": 100.0, "page-size": PAGE},
                    "downtime": 12, "total-time": 1000}
        if command == "query-commands":
            return [{"name": c} for c in sorted(self.commands)]
        if command == "query-status":
            return {"status": self.status, "running": self.status == "running"}
        if command == "cont":
            self.status = "running"
            return {}
        if command == "stop":  # QEMU: on an incoming VM, only autostart is cleared
            if self.status == "inmigrate":
                self.autostart = False
            elif self.status == "running":
                self.status = "paused"
            return {}
        if command == "x-query-ram-digest":
            if "x-query-ram-digest" not in self.commands:
                raise VMError(f"{self.name}: command not found")
            if self.status == "running":
                raise VMError(f"{self.name}: refused while the VM runs")
            if "threads" in args and not self.digest_threads:
                raise VMError(f"{self.name}: Parameter 'threads' is unexpected")
            return self._digest(args)
        if command == "query-cpus-fast":
            return [{"cpu-index": i} for i in range(self.vcpus)]
        if command == "human-monitor-command" and args.get("command-line") == "info ramblock":
            return "".join(f"{n:>24} {'4 KiB':>8}  0x{0:016x} 0x{len(d):016x} 0x{len(d):016x} "
                           f"0x{0:016x} {'rw':>3}\n" for n, d in self.ram.items())
        if command in self.commands:
            return {}
        raise VMError(f"{self.name}: {command}: not scripted")

    def _digest(self, args: dict[str, Any]) -> dict[str, Any]:
        chunk = int(args.get("chunk-size", 1 << 20))
        blocks = []
        for name, data in self.ram.items():
            if "block" in args and args["block"] != name:
                continue
            off = int(args.get("offset", 0))
            length = int(args.get("length", len(data) - off))
            digests = [hashlib.sha256(bytes(data[o:min(o + chunk, off + length)])).hexdigest()
                       for o in range(off, off + length, chunk)]
            blocks.append({"name": name, "size": len(data), "offset": off, "digests": digests})
        return {"algorithm": "sha256", "chunk-size": chunk, "blocks": blocks}
