"""Workload specs (``mem:size=512M,rate=200M,hot=80/10+disk:bs=8K``).

The grammar is shared with the guest agent (docs/agent-protocol.md); the host parses
it too so that a typo is a one-line error before any VM boots, and so the report can
say what ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from livemig.errors import UsageError
from livemig.units import parse_size

FILLS = ("mixed", "random", "text", "zero")


@dataclass(frozen=True)
class MemLoad:
    size: int = 256 << 20
    rate: int = 0  # bytes of pages dirtied per second; 0 = flat out
    hot_percent: int | None = None  # P% of writes ...
    hot_fraction: int | None = None  # ... land in the first F% of the region
    zipf: float | None = None
    fill: str = "mixed"
    touch: int = 64
    threads: int = 1
    after: int = 0  # seconds idle before the first write (a guest that turns busy)


@dataclass(frozen=True)
class DiskLoad:
    bs: int = 4096
    rate: int = 1 << 20
    dev: str = "/dev/vda"
    size: int | None = None


@dataclass(frozen=True)
class VerifyLoad:
    mem: int = 0
    disk: int = 0
    rate: int = 8 << 20  # bytes/s of blocks rewritten with a new generation


SERVICES = ("pgbench", "redis")


@dataclass(frozen=True)
class ServiceLoad:
    """A real service in a Debian rootfs guest (guest/rootfs/images/) under a load
    generator on the client host; its throughput is measured by the client.

    - ``pgbench:scale=N,clients=C``: PostgreSQL with pgbench's tables at scale N (the
      guest image is built per scale), C pgbench clients (TPC-B-like transactions).
    - ``redis:keys=N,clients=C,value=SIZE,reads=P``: Redis with N keys of SIZE bytes,
      C connections doing P % reads and the rest writes."""

    kind: str
    scale: int = 20
    clients: int = 4
    keys: int = 200_000
    value: int = 1024
    reads: int = 80

    @property
    def image(self) -> str:
        return "postgres" if self.kind == "pgbench" else "redis"

    @property
    def image_params(self) -> tuple[str, ...]:
        return (f"scale={self.scale}",) if self.kind == "pgbench" else ()

    @property
    def dataset_bytes(self) -> int:
        """About what the service keeps in guest RAM (to check it fits the VM)."""
        if self.kind == "pgbench":
            return self.scale * (15 << 20)
        return 2 * self.keys * (self.value + 80)  # dataset + write set, with overhead


@dataclass(frozen=True)
class Workload:
    """A parsed workload spec; ``text`` is the canonical form sent to the guest."""

    text: str
    mem: tuple[MemLoad, ...] = field(default_factory=tuple)
    disk: tuple[DiskLoad, ...] = field(default_factory=tuple)
    verify: VerifyLoad | None = None
    service: ServiceLoad | None = None

    @property
    def is_idle(self) -> bool:
        return not (self.mem or self.disk or self.verify or self.service)

    @property
    def mem_bytes(self) -> int:
        """Guest memory the workload needs, to check it fits the VM."""
        return sum(m.size for m in self.mem) + (self.verify.mem if self.verify else 0)


def _kv(item: str, body: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not body:
        return out
    for part in body.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise UsageError(f"bad workload item {item!r}: expected key=value, got {part!r}")
        if key in out:
            raise UsageError(f"bad workload item {item!r}: {key} given twice")
        out[key] = value
    return out


def _int(item: str, key: str, value: str, lo: int, hi: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"bad workload item {item!r}: {key} must be an integer") from None
    if not lo <= n <= hi:
        raise UsageError(f"bad workload item {item!r}: {key} must be in {lo}..{hi}")
    return n


def _parse_mem(item: str, kv: dict[str, str]) -> MemLoad:
    args: dict[str, object] = {}
    for key, value in kv.items():
        if key == "size":
            size = parse_size(value, f"{item}: size")
            if size < 4096:
                raise UsageError(f"bad workload item {item!r}: size must be at least 4K")
            args["size"] = size
        elif key == "rate":
            args["rate"] = parse_size(value, f"{item}: rate")
        elif key == "hot":
            p, sep, f = value.partition("/")
            if not sep:
                raise UsageError(f"bad workload item {item!r}: hot must be P/F, e.g. 80/10")
            args["hot_percent"] = _int(item, "hot P", p, 1, 100)
            args["hot_fraction"] = _int(item, "hot F", f, 1, 100)
        elif key == "zipf":
            try:
                s = float(value)
            except ValueError:
                raise UsageError(f"bad workload item {item!r}: zipf must be a number") from None
            if not 0 < s <= 10:
                raise UsageError(f"bad workload item {item!r}: zipf must be in (0, 10]")
            args["zipf"] = s
        elif key == "fill":
            if value not in FILLS:
                raise UsageError(f"bad workload item {item!r}: fill must be one of {FILLS}")
            args["fill"] = value
        elif key == "touch":
            args["touch"] = _int(item, "touch", str(parse_size(value)), 1, 4096)
        elif key == "threads":
            args["threads"] = _int(item, "threads", value, 1, 64)
        elif key == "after":
            args["after"] = _int(item, "after", value, 0, 3600)
        else:
            raise UsageError(f"bad workload item {item!r}: unknown key {key!r} for mem")
    if "hot_percent" in args and "zipf" in args:
        raise UsageError(f"bad workload item {item!r}: hot and zipf exclude each other")
    return MemLoad(**args)  # type: ignore[arg-type]


def _parse_disk(item: str, kv: dict[str, str]) -> DiskLoad:
    args: dict[str, object] = {}
    for key, value in kv.items():
        if key == "bs":
            bs = parse_size(value, f"{item}: bs")
            if bs < 512 or bs % 512:
                raise UsageError(f"bad workload item {item!r}: bs must be a multiple of 512")
            args["bs"] = bs
        elif key == "rate":
            args["rate"] = parse_size(value, f"{item}: rate")
        elif key == "dev":
            if not value.startswith("/dev/"):
                raise UsageError(f"bad workload item {item!r}: dev must be a /dev path")
            args["dev"] = value
        elif key == "size":
            args["size"] = parse_size(value, f"{item}: size")
        else:
            raise UsageError(f"bad workload item {item!r}: unknown key {key!r} for disk")
    return DiskLoad(**args)  # type: ignore[arg-type]


def _parse_verify(item: str, kv: dict[str, str]) -> VerifyLoad:
    args: dict[str, int] = {}
    for key, value in kv.items():
        if key not in ("mem", "disk", "rate"):
            raise UsageError(f"bad workload item {item!r}: unknown key {key!r} for verify")
        args[key] = parse_size(value, f"{item}: {key}")
    if not (args.get("mem") or args.get("disk")):
        raise UsageError(f"bad workload item {item!r}: give mem=SIZE and/or disk=SIZE")
    return VerifyLoad(**args)


def _parse_service(item: str, kind: str, kv: dict[str, str]) -> ServiceLoad:
    allowed = {"pgbench": ("scale", "clients"),
               "redis": ("keys", "clients", "value", "reads")}[kind]
    args: dict[str, int] = {}
    for key, value in kv.items():
        if key not in allowed:
            raise UsageError(f"bad workload item {item!r}: unknown key {key!r} for {kind} "
                             f"(keys: {', '.join(allowed)})")
        if key == "scale":
            args[key] = _int(item, key, value, 1, 1000)
        elif key == "clients":
            args[key] = _int(item, key, value, 1, 64)
        elif key == "keys":
            args[key] = _int(item, key, str(parse_size(value, f"{item}: keys")), 1, 50_000_000)
        elif key == "value":
            args[key] = _int(item, key, str(parse_size(value, f"{item}: value")), 1, 1 << 20)
        else:
            args[key] = _int(item, key, value, 0, 100)
    return ServiceLoad(kind=kind, **args)


def parse_workload(text: str) -> Workload:
    """Parse a workload spec; raise UsageError with a one-line message if it is bad."""
    text = text.strip()
    if not text:
        raise UsageError("empty workload spec (use 'idle')")
    if any(c.isspace() for c in text):
        raise UsageError(f"bad workload spec {text!r}: no spaces allowed")
    mem: list[MemLoad] = []
    disk: list[DiskLoad] = []
    verify: VerifyLoad | None = None
    service: ServiceLoad | None = None
    items = text.split("+")
    for item in items:
        kind, _, body = item.partition(":")
        if kind == "idle":
            if body:
                raise UsageError("bad workload item 'idle': takes no options")
        elif kind == "mem":
            mem.append(_parse_mem(item, _kv(item, body)))
        elif kind == "disk":
            disk.append(_parse_disk(item, _kv(item, body)))
        elif kind == "verify":
            if verify is not None:
                raise UsageError("bad workload spec: verify given twice")
            verify = _parse_verify(item, _kv(item, body))
        elif kind in SERVICES:
            if len(items) > 1:
                raise UsageError(f"bad workload spec {text!r}: {kind} runs a service guest "
                                 "of its own; it does not combine with other items")
            service = _parse_service(item, kind, _kv(item, body))
        else:
            raise UsageError(
                f"bad workload item {item!r}: expected idle, mem:..., disk:..., verify:..., "
                "pgbench:... or redis:..."
            )
    return Workload(text=text, mem=tuple(mem), disk=tuple(disk), verify=verify,
                    service=service)
