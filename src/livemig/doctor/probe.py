"""The emulator asked directly: a throwaway ``-machine none`` QEMU over QMP on stdio
(what :mod:`livemig.qemucaps` does before a run, plus its commands and version), and
a stopped q35 machine with no ``-L`` for the firmware (:mod:`livemig.install.firmware`).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path
from typing import Any

from livemig.doctor.facts import QemuFacts
from livemig.install.firmware import boot_check
from livemig.qemucaps import PROBE_ARGS, PROBE_TIMEOUT_S, TLS_PROBE

_ASKS: list[dict[str, Any]] = [
    {"execute": "qmp_capabilities"},
    {"execute": "query-version", "id": "version"},
    {"execute": "query-commands", "id": "commands"},
    {"execute": "query-migrate-capabilities", "id": "caps"},
    {"execute": "query-migrate-parameters", "id": "params"},
    {"execute": "object-add", "arguments": TLS_PROBE, "id": "tls"},
    {"execute": "quit"}]


def _answers(stdout: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError):
            msg = json.loads(line)
            if isinstance(msg, dict) and isinstance(msg.get("id"), str):
                out[msg["id"]] = msg
    return out


def parse(path: str, stdout: str, stderr: str) -> QemuFacts:
    """QEMU's answers (stdout) -> facts; an error fact when they are not a QEMU's."""
    a = _answers(stdout)
    caps, params = a.get("caps", {}).get("return"), a.get("params", {}).get("return")
    cmds = a.get("commands", {}).get("return")
    if not isinstance(caps, list) or not isinstance(params, dict) or \
            not isinstance(cmds, list):
        tail = (stderr.strip().splitlines() or ["no QMP answer"])[-1]
        return QemuFacts(path, error=f"not a QEMU that answers migration queries ({tail})")
    v = a.get("version", {}).get("return", {}).get("qemu", {})
    version = (f"{v.get('major')}.{v.get('minor')}.{v.get('micro')}"
               if isinstance(v, dict) and "major" in v else None)
    tls = a.get("tls", {})
    gnutls = "return" in tls or "GNUTLS" not in str(tls.get("error", {})).upper()
    return QemuFacts(path, version=version,
                     commands=frozenset(str(c.get("name")) for c in cmds),
                     capabilities=frozenset(str(c.get("capability")) for c in caps),
                     parameters=frozenset(str(k) for k in params), gnutls=gnutls)


def probe(path: Path) -> QemuFacts:
    script = "".join(json.dumps(c) + "\n" for c in _ASKS)
    try:
        out = subprocess.run([str(path), *PROBE_ARGS], input=script, capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return QemuFacts(str(path), error=f"did not answer QMP within {PROBE_TIMEOUT_S:.0f}s")
    except OSError as e:
        return QemuFacts(str(path), error=f"cannot run it: {e.strerror}")
    facts = parse(str(path), out.stdout, out.stderr)
    if facts.error:
        return facts
    return QemuFacts(**{**facts.__dict__, "firmware_error": boot_check(path)})
