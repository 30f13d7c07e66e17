"""The doctor as a gate for another command (``livemig evacuate`` before it starts):
only the findings that keep a host out."""

from __future__ import annotations

from pathlib import Path

from livemig.doctor.checks import FAIL, Finding, check
from livemig.doctor.gather import gather


def blocking(uri: str, emulator: Path | None = None, tls_required: bool = True
             ) -> list[Finding]:
    """The ``fail`` findings for the host behind ``uri`` checked with ``emulator`` (the
    domains' ``<emulator>``: a destination must have it); empty when it can take part.
    A daemon that cannot be reached raises the usual one-line error."""
    return [f for f in check(gather(uri, emulator, tls_required)) if f.level == FAIL]
