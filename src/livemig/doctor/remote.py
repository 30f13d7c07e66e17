"""A remote host's emulator, asked through its own libvirt daemon.

Where the host's files are not visible from here, the doctor cannot run the emulator
itself. It asks the daemon instead to start a transient domain of that emulator,
paused before its first instruction (``VIR_DOMAIN_START_PAUSED``: QEMU's ``-S``), with
no disk and no network, and reads its QMP through the monitor passthrough: version,
commands, migration capabilities and parameters (which livemig mechanisms it has),
and whether it can hold TLS credentials. That the machine was created at all is the
firmware check (QEMU loads its BIOS when it builds the machine, before ``-S`` holds
it). Then the domain is destroyed: transient, it leaves nothing defined. This is
what libvirt itself does to learn an emulator's capabilities (a ``-S`` QEMU), through
its public API, with no assumption about the remote host's files.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any
from xml.sax.saxutils import escape

from livemig.doctor.facts import QemuFacts
from livemig.qemucaps import TLS_PROBE
from livemig.virt.conn import LibvirtError, libvirt_module, message

MEMORY_MIB = 32  # QEMU's smallest sensible q35 machine; never runs a guest instruction
NAME_PREFIX = "livemig-doctor-probe"


def domain_xml(name: str, emulator: str) -> str:
    """A paused-only q35 domain of ``emulator``: no disk, no NIC, no display.

    ACPI is named: without it libvirt 9.0 passes ``-no-acpi``, which QEMU 10 no longer
    has (the probe would fail on every current QEMU for a reason of its own making)."""
    return f"""<domain type='qemu'>
  <name>{escape(name)}</name>
  <memory unit='MiB'>{MEMORY_MIB}</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type></os>
  <features><acpi/></features>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>{escape(emulator)}</emulator>
    <controller type='usb' model='none'/>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def _facts(emulator: str, ask: Any) -> QemuFacts:
    """The QMP answers of the probe domain (``ask(execute, **arguments)``)."""
    v = ask("query-version").get("qemu", {})
    version = f"{v.get('major')}.{v.get('minor')}.{v.get('micro')}" if "major" in v else None
    gnutls = True
    try:
        ask("object-add", **TLS_PROBE)
        with contextlib.suppress(LibvirtError):
            ask("object-del", id=TLS_PROBE["id"])
    except LibvirtError as e:
        gnutls = "GNUTLS" not in str(e).upper()
    return QemuFacts(
        emulator, version=version,
        commands=frozenset(str(c["name"]) for c in ask("query-commands")),
        capabilities=frozenset(str(c["capability"])
                               for c in ask("query-migrate-capabilities")),
        parameters=frozenset(str(k) for k in ask("query-migrate-parameters")),
        gnutls=gnutls)


def probe_remote(conn: Any, emulator: str) -> QemuFacts:
    """``emulator`` on the daemon behind ``conn``: its facts, or an error fact (one
    line) when the daemon cannot start it."""
    from livemig.virt.qmp import command

    libvirt = libvirt_module()
    name = f"{NAME_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        dom = conn.createXML(domain_xml(name, emulator), libvirt.VIR_DOMAIN_START_PAUSED)
    except libvirt.libvirtError as e:
        return QemuFacts(emulator, error=f"a paused probe domain of it did not start on the "
                         f"host: {message(e)}")
    try:
        return _facts(emulator, lambda execute, **kw: command(dom, execute, **kw))
    except LibvirtError as e:
        return QemuFacts(emulator, error=f"its probe domain did not answer QMP: {e}")
    finally:
        with contextlib.suppress(libvirt.libvirtError):
            dom.destroy()
