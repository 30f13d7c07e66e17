"""The service guest: a Debian rootfs image (guest/rootfs/) with PostgreSQL or Redis,
booted with the lab's kernel and initramfs, its load generator on the client host."""

from __future__ import annotations

import subprocess
from pathlib import Path

from livemig import paths
from livemig.errors import SetupError
from livemig.services import pgbench, redisload
from livemig.services.client import LoadProcess
from livemig.spec import ServiceLoad

PGBENCH_UNIT = "transactions"
REDIS_UNIT = "operations"


def image_path(svc: ServiceLoad) -> Path:
    suffix = "".join(f"-{p}" for p in svc.image_params)
    return paths.build_dir() / "guest" / "rootfs" / f"{svc.image}{suffix}.img"


def ensure_image(svc: ServiceLoad) -> Path:
    """Build the service's rootfs image if it is missing or stale (cached by key;
    a no-op when nothing changed)."""
    script = paths.repo_root() / "guest" / "rootfs" / "build.sh"
    argv = ["bash", str(script)]
    for p in svc.image_params:
        argv += ["--param", p]
    argv.append(svc.image)
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise SetupError(f"cannot build the {svc.image} guest image: "
                         f"{tail[0] if tail else 'guest/rootfs/build.sh failed'}")
    path = image_path(svc)
    if not path.exists():
        raise SetupError(f"guest/rootfs/build.sh did not produce {path}")
    return path


def copy_image(src: Path, dst: Path) -> None:
    """A run's private copy of the image (sparse)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True)


def kernel_append() -> str:
    """Kernel command line items that make the lab's initramfs boot the rootfs."""
    return "livemig.root=/dev/vda"


def unit(svc: ServiceLoad) -> str:
    return PGBENCH_UNIT if svc.kind == "pgbench" else REDIS_UNIT


def start_load(svc: ServiceLoad, prefix: list[str], host: str) -> LoadProcess:
    """Start the service's load generator (``prefix``: run it on the client host)."""
    if svc.kind == "pgbench":
        return pgbench.start(prefix, host, svc.clients)
    return redisload.start(prefix, host, svc.keys, svc.clients, svc.value, svc.reads)
