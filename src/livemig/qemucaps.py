"""What a QEMU binary offers for migration, asked once per binary, before any guest
boots: its migration capabilities and parameters, so a typo in ``--set`` costs a
second, not two guest boots.

The binary is started with no machine and no devices (``-machine none``), answers
``query-migrate-capabilities`` / ``query-migrate-parameters`` over QMP on stdio,
tries to create TLS credentials (an anonymous ``tls-creds-anon``, which needs no
files: it fails only on a QEMU built without GnuTLS), and quits. The answer is
cached under the run root per binary path, size and modification time (a rebuilt
binary is asked again).
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
from livemig.errors import SetupError, UsageError
from livemig.settings import resolve

PROBE_TIMEOUT_S = 20.0  # a QEMU with no machine answers in well under a second
PROBE_ARGS = ("-machine", "none", "-nodefaults", "-no-user-config", "-display", "none",
              "-qmp", "stdio")
CACHE_VERSION = 2  # 2: the GnuTLS answer
TLS_PROBE = {"qom-type": "tls-creds-anon", "id": "livemig-tls-probe", "endpoint": "server"}


@dataclass(frozen=True)
class MigrationKnobs:
    capabilities: dict[str, bool]
    parameters: dict[str, Any]
    gnutls: bool = True  # TLS credentials can be created (QEMU built with GnuTLS)


def cache_dir() -> Path:
    return paths.run_root() / "qemu-caps"


def _key(binary: Path) -> str:
    st = binary.stat()
    raw = f"{CACHE_VERSION}|{binary.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def probe(binary: Path) -> MigrationKnobs:
    """Ask ``binary`` (no cache)."""
    asks: list[dict[str, Any]] = [
        {"execute": "qmp_capabilities"},
        {"execute": "query-migrate-capabilities", "id": "caps"},
        {"execute": "query-migrate-parameters", "id": "params"},
        {"execute": "object-add", "arguments": TLS_PROBE, "id": "tls"},
        {"execute": "quit"}]
    script = "".join(json.dumps(c) + "\n" for c in asks)
    try:
        out = subprocess.run([str(binary), *PROBE_ARGS], input=script, capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{binary}: did not answer QMP within {PROBE_TIMEOUT_S:.0f}s") \
            from None
    except OSError as e:
        raise SetupError(f"{binary}: cannot run it: {e.strerror}") from None
    answers: dict[str, dict[str, Any]] = {}
    for line in out.stdout.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict) and isinstance(msg.get("id"), str):
                answers[msg["id"]] = msg
    caps, params = answers.get("caps", {}).get("return"), answers.get("params", {}).get("return")
    if not isinstance(caps, list) or not isinstance(params, dict):
        tail = (out.stderr.strip().splitlines() or ["no answer"])[-1]
        raise SetupError(f"{binary}: not a QEMU that answers migration queries ({tail})")
    tls = answers.get("tls", {})
    gnutls = "return" in tls or "GNUTLS" not in str(tls.get("error", {})).upper()
    return MigrationKnobs({str(c["capability"]): bool(c["state"]) for c in caps},
                          dict(params), gnutls)


def knobs(binary: Path) -> MigrationKnobs:
    """The binary's migration capabilities and parameters, cached."""
    try:
        key = _key(binary)
    except OSError as e:
        raise SetupError(f"QEMU binary {binary}: {e.strerror}") from None
    path = cache_dir() / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        d = json.loads(path.read_text())
        return MigrationKnobs(dict(d["capabilities"]), dict(d["parameters"]),
                              bool(d["gnutls"]))
    k = probe(binary)
    with contextlib.suppress(OSError, SetupError):  # no cache where we cannot write
        private.make_dir(cache_dir())
        private.write_text(path, json.dumps({"binary": str(binary), "capabilities":
                                             k.capabilities, "parameters": k.parameters,
                                             "gnutls": k.gnutls}))
    return k


def check_settings(binary: Path, wanted: Mapping[str, str]) -> None:
    """A one-line :class:`UsageError` for a ``--set`` key or value this QEMU would
    refuse, before anything boots (the same resolution the engine does later)."""
    k = knobs(binary)
    resolve(wanted, k.capabilities, k.parameters)


def check_tls(binary: Path) -> None:
    """A one-line :class:`UsageError` when TLS is on and ``binary`` cannot encrypt
    (built without GnuTLS), before anything boots."""
    if not knobs(binary).gnutls:
        raise UsageError(f"{binary} was built without GnuTLS, so it cannot encrypt the "
                         "migration: rebuild it (make setup: qemu/build.sh configures "
                         "--enable-gnutls) or pass --tls off")


def cached(binary: Path) -> bool:
    """Whether the answer for ``binary`` is in the cache (for tests and reports)."""
    try:
        return (cache_dir() / f"{_key(binary)}.json").exists()
    except OSError:
        return False
