"""Choosing the accelerator: KVM only where it can really run a guest.

``/dev/kvm`` existing is not enough: some hosts expose a paravirtual KVM flavour
(PVM) without hardware virtualisation, on which a standard guest kernel hangs at
boot. KVM is chosen automatically only when the CPU advertises vmx or svm and
``/dev/kvm`` can be opened.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from livemig.errors import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AccelChoice:
    name: str  # "kvm" or "tcg"
    reason: str


def _cpu_has_hw_virt(cpuinfo: str) -> bool:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"vmx", "svm"})
    return False


def kvm_usable(
    cpuinfo_path: Path = Path("/proc/cpuinfo"), dev: Path = Path("/dev/kvm")
) -> str | None:
    """Return None if KVM can run a guest here, else the reason it cannot."""
    if not dev.exists():
        return f"{dev} does not exist"
    try:
        fd = os.open(dev, os.O_RDWR)
    except OSError as e:
        return f"{dev} cannot be opened ({e.strerror})"
    os.close(fd)
    try:
        cpuinfo = cpuinfo_path.read_text()
    except OSError as e:
        return f"cannot read {cpuinfo_path} ({e.strerror})"
    if not _cpu_has_hw_virt(cpuinfo):
        return ("no vmx/svm in /proc/cpuinfo (a paravirtual KVM such as PVM cannot boot "
                "a stock guest)")
    return None


def choose_accel(requested: str) -> AccelChoice:
    """Resolve ``auto|kvm|tcg`` into the accelerator to use, with the reason."""
    if requested not in ("auto", "kvm", "tcg"):
        raise UsageError(f"bad --accel {requested!r}: expected auto, kvm or tcg")
    if requested == "tcg":
        return AccelChoice("tcg", "requested")
    problem = kvm_usable()
    if requested == "kvm":
        if problem:
            raise UsageError(f"--accel kvm: KVM cannot run a guest here: {problem}")
        return AccelChoice("kvm", "requested")
    if problem:
        return AccelChoice("tcg", f"auto: KVM unusable: {problem}")
    return AccelChoice("kvm", "auto: /dev/kvm usable and CPU has vmx/svm")
