"""The doctor as a gate for another command (``livemig evacuate`` before it starts):
the findings that keep a host out, and whether its emulator is a stock QEMU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from livemig.doctor.checks import FAIL, Finding, check
from livemig.doctor.facts import HostFacts
from livemig.doctor.gather import gather
from livemig.virt.plan import lacks_peer_mechanisms


@dataclass(frozen=True)
class Verdict:
    fails: list[Finding]  # empty: the host can take part
    # how the probe showed the emulator lacks the patched build's stream mechanisms
    # (a migration toward it goes as toward a stock QEMU); None: it has them, or its
    # emulator could not be probed from here (a remote host's)
    stock: str | None


def examine(uri: str, emulator: Path | None = None, tls_required: bool = True) -> Verdict:
    """The host behind ``uri`` checked with ``emulator`` (the domains' ``<emulator>``:
    a destination must have it). A daemon that cannot be reached raises the usual
    one-line error."""
    facts = gather(uri, emulator, tls_required)
    return Verdict([f for f in check(facts) if f.level == FAIL], stock(facts))


def stock(facts: HostFacts) -> str | None:
    """How the host's probed emulator shows it lacks the stream mechanisms a patched
    source would send it (None: it has them all, or it was not probed)."""
    q = facts.qemu
    if q is None or q.error:
        return None
    lacking = lacks_peer_mechanisms(q.capabilities, q.parameters)
    if not lacking:
        return None
    return f"livemig doctor: {q.path} has no {', '.join(lacking)}"
