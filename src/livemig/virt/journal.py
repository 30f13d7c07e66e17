"""What a libvirt run changed on a domain's QEMUs, written down before it changes it,
so that the next run for the same domain undoes what a dead one (kill -9) left.

One small JSON file per domain name under ``/run/livemig/libvirt-journal/``
(not named ``state.json``: run directories use that name), with the owner's pid and
start time; removed when the run ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from livemig import paths


def _dir() -> Path:
    return paths.run_root() / "libvirt-journal"


def path(domain: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", domain)[:64]
    return _dir() / f"{safe}-{hashlib.sha1(domain.encode()).hexdigest()[:8]}.json"


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time


def write(domain: str, **data: Any) -> None:
    p = path(domain)
    p.parent.mkdir(parents=True, exist_ok=True)
    record = {"domain": domain, "owner_pid": os.getpid(),
              "owner_start": _start_time(os.getpid()), **data}
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, p)


def read(domain: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path(domain).read_text()))
    except (OSError, ValueError):
        return None


def remove(domain: str, owner_pid: int | None = None) -> None:
    """``owner_pid``: only while the record is still that process's (a guard must not
    remove the record of a newer run for the same domain)."""
    if owner_pid is not None:
        current = read(domain)
        if current is None or current.get("owner_pid") != owner_pid:
            return
    with contextlib.suppress(FileNotFoundError):
        path(domain).unlink()


def left_by_dead_run(domain: str) -> dict[str, Any] | None:
    """The record of a run for this domain whose process is gone, if any."""
    data = read(domain)
    if data is None:
        return None
    pid = data.get("owner_pid")
    if isinstance(pid, int) and _start_time(pid) == data.get("owner_start") is not None:
        return None  # its owner still runs
    return data
