"""What ``livemig doctor`` gathered about one host: plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QemuFacts:
    """The emulator as asked over QMP (``-machine none``) and started as a stopped q35
    machine with no ``-L`` (the firmware check); only where its file is visible."""

    path: str
    version: str | None = None  # "10.2.2"
    commands: frozenset[str] = frozenset()
    capabilities: frozenset[str] = frozenset()
    parameters: frozenset[str] = frozenset()
    gnutls: bool = True
    error: str | None = None  # why it could not be asked (not a QEMU, cannot run)
    firmware_error: str | None = None  # None: a q35 machine started with no -L


@dataclass(frozen=True)
class HostFacts:
    uri: str
    hostname: str | None = None
    libvirt_version: int | None = None  # libvirt's encoding: major*1e6 + minor*1e3 + micro
    hypervisor_version: int | None = None  # the QEMU version libvirt reports
    emulator: str | None = None  # the emulator checked
    emulator_given: bool = False  # --emulator (else the domain capabilities' default)
    domcaps_error: str | None = None  # libvirt could not describe the emulator: why
    libvirt_kvm: bool | None = None  # libvirt offers virttype kvm for the emulator
    local: bool = False  # the host's files are visible from here (this machine)
    kvm_problem: str | None = None  # local: why KVM cannot run a guest (None: it can)
    qemu: QemuFacts | None = None  # None: not probed (a remote host's emulator)
    tls_required: bool = True
    tls_dir: str | None = None  # the daemon's migration certificates (local hosts)
    tls_missing: tuple[str, ...] | None = None  # None: not checked (a remote host)
    free_memory: int | None = None  # bytes
    total_memory: int | None = None  # bytes
    running: int | None = None  # running domains
    confined: bool | None = None  # libvirt confines QEMU with AppArmor (None: unknown)
    confinement_allows: bool | None = None  # its profiles let the emulator run
