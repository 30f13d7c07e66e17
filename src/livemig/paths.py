"""Where livemig finds its build products and puts its run-time files."""

from __future__ import annotations

import os
from pathlib import Path

from livemig.errors import SetupError

FIRMWARE_DIRS = (Path("/usr/share/seabios"), Path("/usr/share/qemu"))


def repo_root() -> Path:
    """The checkout livemig runs from (``LIVEMIG_ROOT`` overrides)."""
    env = os.environ.get("LIVEMIG_ROOT")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2]


def build_dir() -> Path:
    return repo_root() / "build"


def default_qemu() -> Path:
    return build_dir() / "qemu" / "qemu-system-x86_64"


def guest_kernel() -> Path:
    return build_dir() / "guest" / "vmlinuz"


def guest_initrd() -> Path:
    return build_dir() / "guest" / "initrd.img"


def run_root() -> Path:
    """Per-run directories (sockets, logs) live here."""
    return Path(os.environ.get("LIVEMIG_RUN_DIR", "/run/livemig"))


def shm_root() -> Path:
    """Guest RAM backing files (shared, so RAM can be compared page by page)."""
    return Path(os.environ.get("LIVEMIG_SHM_DIR", "/dev/shm"))


def require_file(path: Path, what: str, hint: str) -> Path:
    if not path.exists():
        raise SetupError(f"{what} not found at {path}: {hint}")
    return path


def ensure_root() -> None:
    from livemig.errors import UsageError

    if os.geteuid() != 0:
        raise UsageError("livemig must run as root (namespaces, /run/livemig, /dev/shm)")
