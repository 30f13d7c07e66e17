"""Facts read from a domain's XML and its daemons, and the copied disks'
comparison on the testbed (both hosts' images are files on this machine)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

from livemig.lab.diskcheck import compare_images
from livemig.lab.faults import flip_byte


def writable_disks(xml: str) -> dict[str, str]:
    """target dev -> source path of the domain's writable file/block disks."""
    out: dict[str, str] = {}
    for disk in ET.fromstring(xml).findall("./devices/disk"):
        if disk.get("device", "disk") != "disk" or disk.find("readonly") is not None:
            continue
        src, tgt = disk.find("source"), disk.find("target")
        if src is None or tgt is None:
            continue
        path = src.get("file") or src.get("dev")
        if path and tgt.get("dev"):
            out[str(tgt.get("dev"))] = path
    return out


def emulator(xml: str) -> str | None:
    e = ET.fromstring(xml).find("./devices/emulator")
    return None if e is None else e.text


def version(v: int) -> str:
    return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"


def cpu_seconds(dom: Any) -> float | None:
    try:  # virDomainGetInfo's cpuTime: the QEMU process's, also without cgroups
        return float(dom.info()[4]) / 1e9
    except Exception:  # libvirt error (domain gone)
        return None


def host_uuid(conn: Any) -> str | None:
    try:
        return ET.fromstring(conn.getCapabilities()).findtext("./host/uuid")
    except Exception:
        return None


def same_file_on_both(src_uri: str, dst_uri: str, paths: list[str]) -> str | None:
    """A disk path both testbed hosts see as the same file (cannot be copied)."""
    from livemig.testbed import libvirtd
    from livemig.virt.conn import testbed_side

    a, b = testbed_side(src_uri), testbed_side(dst_uri)
    if a is None or b is None:
        return None
    for p in paths:
        if libvirtd.host_view(a, p) == libvirtd.host_view(b, p):
            return p
    return None


def compare_copied_disks(src_uri: str, dst_uri: str, disks: dict[str, str],
                         fault: int | None, event: Callable[..., None]) -> dict[str, Any]:
    """Compare each copied disk's two images byte for byte (the destination is held
    paused). ``fault``: debug, flip that byte of the first destination image first."""
    from livemig.testbed import libvirtd
    from livemig.virt.conn import testbed_side

    a_side, b_side = testbed_side(src_uri), testbed_side(dst_uri)
    if a_side is None or b_side is None:
        return {"result": "skipped", "why": "the images are on two hosts: comparing "
                "them needs read-only NBD exports of both (not implemented)"}
    details = {}
    ok = True
    for i, (target, path) in enumerate(disks.items()):
        a = libvirtd.host_view(a_side, path)
        b = libvirtd.host_view(b_side, path)
        if i == 0 and fault is not None:
            flip_byte(b, fault)
            event("fault injected", kind="disk-byte", offset=f"{fault:#x}", image=str(b))
        res = compare_images(a, b).as_dict()
        details[target] = {"source": str(a), "destination": str(b), **res}
        ok = ok and res["result"] == "ok"
    event("disks compared", result="ok" if ok else "mismatch")
    return {"result": "ok" if ok else "mismatch", "disks": details}
