"""Facts read from a domain's XML and its daemons, and the copied disks'
comparison: through libvirt's storage API on any hosts (``volumes``), or as files
on the testbed, where both hosts' images are files on this machine."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from livemig.errors import LivemigError
from livemig.lab.diskcheck import compare_images
from livemig.lab.faults import flip_byte
from livemig.virt import volumes
from livemig.virt.volumes import Skipped


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


def disk_aliases(xml: str) -> dict[str, str]:
    """target dev -> device alias (libvirt's qdev id, e.g. virtio-disk0) of the
    running domain's disks (live XML)."""
    out: dict[str, str] = {}
    for disk in ET.fromstring(xml).findall("./devices/disk"):
        tgt, alias = disk.find("target"), disk.find("alias")
        if tgt is not None and alias is not None and tgt.get("dev") and alias.get("name"):
            out[str(tgt.get("dev"))] = str(alias.get("name"))
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


FILE_METHOD = "image files on this machine (testbed), byte for byte"
NBD_METHOD = ("read-only NBD exports of each end's QEMU block node (guest-visible data, "
              "SHA-256 per 1 MiB)")
METHODS = {"file": FILE_METHOD, "stream": volumes.METHOD, "nbd": NBD_METHOD}


def on_one_machine(src_uri: str, dst_uri: str) -> bool:
    """Whether this machine can open both hosts' image files (the testbed)."""
    from livemig.virt.conn import testbed_side

    return testbed_side(src_uri) is not None and testbed_side(dst_uri) is not None


def disk_formats(xml: str) -> dict[str, str]:
    """target dev -> the image format QEMU reads (``<driver type>``; raw if unset)."""
    out: dict[str, str] = {}
    for disk in ET.fromstring(xml).findall("./devices/disk"):
        tgt, drv = disk.find("target"), disk.find("driver")
        if tgt is not None and tgt.get("dev"):
            out[str(tgt.get("dev"))] = (drv.get("type") if drv is not None else None) or "raw"
    return out


@dataclass(frozen=True)
class DiskEnds:
    """The two daemons of a copied-storage migration."""

    src_uri: str
    dst_uri: str
    src_conn: Any
    dst_conn: Any


def compare_copied_disks(ends: DiskEnds, disks: dict[str, str], formats: dict[str, str],
                         method: str, fault: int | None,
                         event: Callable[..., None],
                         nbd_ends: NbdEnds | None = None) -> dict[str, Any]:
    """Compare each copied disk's two copies (the destination is held paused):
    ``method`` ``nbd`` reads both through read-only NBD exports of a QEMU on each
    host (guest-visible data: any format; ``nbd_ends`` says which), ``stream`` reads
    both images through libvirt's storage API (any hosts, raw only), ``file`` opens
    both files (the testbed, raw only). ``fault``: debug, flip that byte of the
    first destination disk first. One disk's mismatch makes the whole a mismatch;
    else one that could not be compared makes it ``skipped``."""
    if method == "nbd":
        assert nbd_ends is not None
        details = _compare_nbd(ends, nbd_ends, disks, fault, event)
    else:
        details = _compare_images(ends, disks, formats, method, fault, event)
    results = {d["result"] for d in details.values()}
    result = ("mismatch" if "mismatch" in results else
              "skipped" if "skipped" in results or not results else "ok")
    event("disks compared", result=result, method=method)
    out: dict[str, Any] = {"result": result, "method": METHODS[method], "disks": details}
    if result == "skipped":
        out["why"] = "; ".join(f"{t}: {d['why']}" for t, d in details.items()
                               if d["result"] == "skipped") or "no disk"
    return out


@dataclass(frozen=True)
class NbdEnds:
    """What the NBD comparison needs besides the daemons: the held-paused
    destination domain and the source domain's XML (for the reader QEMU)."""

    domain: str
    domain_xml: str
    dst_dom: Any
    tls: bool = False  # the exports over TLS (the run uses VIR_MIGRATE_TLS)


def _compare_nbd(ends: DiskEnds, n: NbdEnds, disks: dict[str, str], fault: int | None,
                 event: Callable[..., None]) -> dict[str, dict[str, Any]]:
    from livemig.virt import diskcheck

    try:
        return diskcheck.compare(diskcheck.Side(ends.src_uri, ends.src_conn, n.tls),
                                 diskcheck.Side(ends.dst_uri, ends.dst_conn, n.tls),
                                 n.dst_dom,
                                 n.domain_xml, n.domain, disks, fault, event)
    except (Skipped, LivemigError) as e:
        return {t: {"result": "skipped", "method": diskcheck.METHOD, "why": str(e)}
                for t in disks}


def _compare_images(ends: DiskEnds, disks: dict[str, str], formats: dict[str, str],
                    method: str, fault: int | None,
                    event: Callable[..., None]) -> dict[str, dict[str, Any]]:
    one = _compare_stream if method == "stream" else _compare_files
    details: dict[str, dict[str, Any]] = {}
    for i, (target, path) in enumerate(disks.items()):
        fmt = formats.get(target, "raw")
        if fmt != "raw":
            details[target] = {"result": "skipped", "why": (
                f"{fmt} image: its file is a container whose bytes differ between two "
                "correct copies; only raw images are compared this way (disk-check=nbd "
                "compares guest-visible data)")}
            continue
        try:
            details[target] = one(ends, path, fault if i == 0 else None, event)
        except Skipped as e:
            details[target] = {"result": "skipped", "why": str(e)}
    return details


def _compare_stream(ends: DiskEnds, path: str, fault: int | None,
                    event: Callable[..., None]) -> dict[str, Any]:
    if fault is not None:
        event("fault injected", kind="disk-byte", offset=f"{fault:#x}",
              image=f"{path} on {ends.dst_uri} (libvirt volume upload)")
    res = volumes.compare_volume(ends.src_conn, ends.dst_conn, path, fault)
    return {"source": f"{ends.src_uri} {path}", "destination": f"{ends.dst_uri} {path}",
            **res}


def _compare_files(ends: DiskEnds, path: str, fault: int | None,
                   event: Callable[..., None]) -> dict[str, Any]:
    from livemig.testbed import libvirtd
    from livemig.virt.conn import testbed_side

    a_side, b_side = testbed_side(ends.src_uri), testbed_side(ends.dst_uri)
    # disk_check_method() picks file only where this machine sees both images
    assert a_side is not None and b_side is not None
    a, b = libvirtd.host_view(a_side, path), libvirtd.host_view(b_side, path)
    if fault is not None:
        flip_byte(b, fault)
        event("fault injected", kind="disk-byte", offset=f"{fault:#x}", image=str(b))
    res = compare_images(a, b).as_dict()
    return {"source": str(a), "destination": str(b), "method": FILE_METHOD, **res}
