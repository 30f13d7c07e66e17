"""QMP through libvirt's monitor passthrough (``libvirt_qemu.qemuMonitorCommand``).

Used only for what libvirt has no API for (see ``plan``): libvirt marks such a domain
as tainted ("custom-monitor"), which is expected of a tool driving patched knobs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from livemig.virt.conn import LibvirtError, libvirt_module, message
from livemig.virt.plan import QemuInfo

log = logging.getLogger(__name__)


def command(dom: Any, execute: str, **arguments: Any) -> Any:
    """Run one QMP command on the domain's QEMU and return its ``return`` value."""
    libvirt = libvirt_module()
    import libvirt_qemu  # type: ignore[import-untyped]

    cmd: dict[str, Any] = {"execute": execute}
    if arguments:
        cmd["arguments"] = arguments
    try:
        reply = libvirt_qemu.qemuMonitorCommand(dom, json.dumps(cmd), 0)
    except libvirt.libvirtError as e:
        raise LibvirtError(f"{execute}: {message(e)}") from None
    data = json.loads(reply)
    if "error" in data:
        raise LibvirtError(f"{execute}: {data['error'].get('desc', data['error'])}")
    return data.get("return")


def probe(dom: Any) -> QemuInfo:
    """Capabilities, parameters and commands of the domain's (source) QEMU."""
    caps = command(dom, "query-migrate-capabilities")
    params = command(dom, "query-migrate-parameters")
    cmds = command(dom, "query-commands")
    try:
        mem = command(dom, "query-memory-size-summary")
        ram: int | None = int(mem.get("base-memory", 0)) + int(mem.get("plugged-memory", 0))
    except (LibvirtError, TypeError, ValueError, AttributeError):
        ram = None
    return QemuInfo(capabilities=frozenset(c["capability"] for c in caps),
                    parameters=dict(params), commands=frozenset(c["name"] for c in cmds),
                    ram_bytes=ram)


def current_capabilities(dom: Any) -> dict[str, bool]:
    return {c["capability"]: bool(c["state"])
            for c in command(dom, "query-migrate-capabilities")}
