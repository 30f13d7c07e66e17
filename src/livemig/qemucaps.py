"""What a QEMU binary offers for migration, asked once per binary, before any guest
boots: its migration capabilities and parameters, so a typo in ``--set`` costs a
second, not two guest boots.

The binary is started with no machine and no devices (``-machine none``), answers
``query-migrate-capabilities`` / ``query-migrate-parameters`` over QMP on stdio,
and quits. The answer is cached under the run root per binary path, size and
modification time (a rebuilt binary is asked again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig import paths, private
from livemig.errors import SetupError
from livemig.settings import resolve

PROBE_TIMEOUT_S = 20.0  # a QEMU with no machine answers in well under a second
PROBE_ARGS = ("-machine", "none", "-nodefaults", "-no-user-config", "-display", "none",
              "-qmp", "stdio")
CACHE_VERSION = 1


@dataclass(frozen=True)
class MigrationKnobs:
    capabilities: dict[str, bool]
    parameters: dict[str, Any]


def cache_dir() -> Path:
    return paths.run_root() / "qemu-caps"


def _key(binary: Path) -> str:
    st = binary.stat()
    raw = f"{CACHE_VERSION}|{binary.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def probe(binary: Path) -> MigrationKnobs:
    """Ask ``binary`` (no cache)."""
    script = "".join(json.dumps({"execute": c}) + "\n" for c in (
        "qmp_capabilities", "query-migrate-capabilities", "query-migrate-parameters",
        "quit"))
    try:
        out = subprocess.run([str(binary), *PROBE_ARGS], input=script, capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{binary}: did not answer QMP within {PROBE_TIMEOUT_S:.0f}s") \
            from None
    except OSError as e:
        raise SetupError(f"{binary}: cannot run it: {e.strerror}") from None
    returns = []
    for line in out.stdout.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict) and "return" in msg:
                returns.append(msg["return"])
    if len(returns) < 3 or not isinstance(returns[1], list) \
            or not isinstance(returns[2], dict):
        tail = (out.stderr.strip().splitlines() or ["no answer"])[-1]
        raise SetupError(f"{binary}: not a QEMU that answers migration queries ({tail})")
    caps = {str(c["capability"]): bool(c["state"]) for c in returns[1]}
    return MigrationKnobs(caps, dict(returns[2]))


def knobs(binary: Path) -> MigrationKnobs:
    """The binary's migration capabilities and parameters, cached."""
    try:
        key = _key(binary)
    except OSError as e:
        raise SetupError(f"QEMU binary {binary}: {e.strerror}") from None
    path = cache_dir() / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(path.read_text())
        return MigrationKnobs(dict(d["capabilities"]), dict(d["parameters"]))
    k = probe(binary)
    with contextlib.suppress(OSError, SetupError):  # no cache where we cannot write
        private.make_dir(cache_dir())
        private.write_text(path, json.dumps({"binary": str(binary), "capabilities":
                                             k.capabilities, "parameters": k.parameters}))
    return k


def check_settings(binary: Path, wanted: Mapping[str, str]) -> None:
    """A one-line :class:`UsageError` for a ``--set`` key or value this QEMU would
    refuse, before anything boots (the same resolution the engine does later)."""
    k = knobs(binary)
    resolve(wanted, k.capabilities, k.parameters)


def cached(binary: Path) -> bool:
    """Whether the answer for ``binary`` is in the cache (for tests and reports)."""
    try:
        return (cache_dir() / f"{_key(binary)}.json").exists()
    except OSError:
        return False
