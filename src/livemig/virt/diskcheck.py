"""Copied disks compared through read-only NBD exports of each end's QEMU block node.

After a ``--storage copy`` migration with ``VIR_MIGRATE_PAUSED`` both copies are
quiescent: the destination domain is held paused, and the source's image is closed
(libvirt stops the source QEMU inside the completing call, in its Confirm phase,
so no source QEMU is left to ask). Each side's image is therefore read by a QEMU
on its own host:

- the destination: the held-paused domain's own QEMU, by monitor passthrough
  (``nbd-server-start`` on the host's migration address, ``block-export-add``
  ``type=nbd writable=false allow-inactive=true`` of the disk's node: the export
  neither activates nor changes it);
- the source: a *reader* QEMU the source daemon starts for a few seconds: a
  transient domain, paused, never run, with the copied images attached read-only
  (``VIR_DOMAIN_START_PAUSED | VIR_DOMAIN_START_AUTODESTROY``: libvirt destroys it
  when livemig's connection closes, even if livemig dies), exporting them the same
  way.

An export serves guest-visible data (QEMU's block layer decodes the format), so a
qcow2 image compares the same as a raw one. The reader (:mod:`livemig.virt.nbd`)
hashes 1 MiB blocks with SHA-256, both sides at once; a difference names the first
differing blocks (offsets) and, from a re-read of the first one, the first differing
byte. On the testbed each side's socket is opened inside that host's namespace, so
its data crosses only that host's loopback; between real hosts livemig reads both
exports over the migration network. A run with TLS (``VIR_MIGRATE_TLS``) serves the
exports over TLS too: a ``tls-creds-x509`` object (``endpoint=server``,
``verify-peer``) from the host's certificate directory in each QEMU, and livemig
shows a client certificate of the same PKI. Every export, NBD server and reader domain is
removed afterwards, whatever happens.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.errors import LivemigError
from livemig.tls import creds
from livemig.virt import nbd, qmp, volumes
from livemig.virt.chunks import (
    CHUNK,
    Digests,
    chunk_range,
    diff_chunks,
    first_differing_byte,
)
from livemig.virt.conn import LibvirtError, libvirt_module, message, testbed_side
from livemig.virt.facts import NBD_METHOD, disk_aliases
from livemig.virt.volumes import Skipped

METHOD = NBD_METHOD
EXPORT_PREFIX = "livemig-check-"
TLS_ID = "livemig-nbd-tls"
PORTS = (49400, 49899)  # the NBD server's port is drawn from here (tried a few times)
PORT_TRIES = 8
READER_MEMORY_MIB = 16  # the reader domain never runs: its RAM is never touched
MAX_LISTED = 16  # differing blocks named in the report


@dataclass(frozen=True)
class Side:
    """One end: its libvirt URI and connection, the address its QEMU listens on;
    ``tls``: the exports take x509 credentials (a run with ``VIR_MIGRATE_TLS``)."""

    uri: str
    conn: Any
    tls: bool = False

    @property
    def tls_dir(self) -> Path:
        """The host's x509 directory: what its daemon's ``migrate_tls_x509_cert_dir``
        names on the testbed; else libvirt's default (``/etc/pki/qemu``), which holds
        the server and client certificates of that host."""
        side = testbed_side(self.uri)
        if side is not None:
            from livemig.tls import testbed as tls_testbed

            return tls_testbed.host_dir(side)
        return creds.STANDARD_DIRS[0]

    def client_tls(self) -> ssl.SSLContext | None:
        """livemig's client side: this machine's certificates of the same layout."""
        return nbd.client_tls(self.tls_dir) if self.tls else None

    @property
    def address(self) -> str:
        host = urllib.parse.urlsplit(self.uri).hostname
        return host or "127.0.0.1"  # a local URI: livemig runs on that host

    def connector(self, port: int) -> Callable[[], socket.socket]:
        """The socket to this side's export: inside the testbed host's namespace."""
        connect = nbd.tcp(self.address, port)
        side = testbed_side(self.uri)
        if side is None:
            return connect
        from livemig.testbed import netns, topology

        ns = topology.HOSTS[side]
        return lambda: netns.call_in(ns, connect)


def node_of(dom: Any, alias: str) -> str:
    """The block node behind the device ``alias`` (libvirt's qdev id)."""
    return _block_of(dom, alias)[0]


def _block_of(dom: Any, alias: str) -> tuple[str, str]:
    """The device's block node and its QOM path (what ``qemu-io -d`` names)."""
    for b in qmp.command(dom, "query-block") or []:
        qdev = str(b.get("qdev", ""))
        if qdev in (alias, f"/machine/peripheral/{alias}") or \
                f"/machine/peripheral/{alias}/" in qdev:
            node = (b.get("inserted") or {}).get("node-name")
            if node:
                return str(node), qdev
    raise Skipped(f"device {alias}: no block node in query-block")


def aliases(dom: Any) -> dict[str, str]:
    """target dev -> device alias of the running domain's disks."""
    return disk_aliases(dom.XMLDesc(0))


@contextlib.contextmanager
def exports(dom: Any, side: Side, nodes: dict[str, str]) -> Iterator[int]:
    """An NBD server on ``side``'s address with a read-only export of each node
    (named ``livemig-check-<target>``); yields its port; all removed afterwards."""
    creds_id = None
    if side.tls:
        creds_id = TLS_ID
        qmp.command(dom, "object-add", **{"qom-type": "tls-creds-x509", "id": TLS_ID,
                                          "dir": str(side.tls_dir), "endpoint": "server",
                                          "verify-peer": True})
    try:
        port = _start_server(dom, side.address, creds_id)
    except BaseException:
        if creds_id:
            with contextlib.suppress(LivemigError):
                qmp.command(dom, "object-del", id=creds_id)
        raise
    added: list[str] = []
    try:
        for target, node in nodes.items():
            _add_export(dom, f"{EXPORT_PREFIX}{target}", node)
            added.append(f"{EXPORT_PREFIX}{target}")
        yield port
    finally:
        for name in added:
            with contextlib.suppress(LivemigError):
                qmp.command(dom, "block-export-del", id=name, mode="hard")
        with contextlib.suppress(LivemigError):
            qmp.command(dom, "nbd-server-stop")
        if creds_id:
            with contextlib.suppress(LivemigError):
                qmp.command(dom, "object-del", id=creds_id)


def _start_server(dom: Any, address: str, creds_id: str | None) -> int:
    last = ""
    for _ in range(PORT_TRIES):
        port = random.randint(*PORTS)
        extra = {"tls-creds": creds_id} if creds_id else {}
        try:
            qmp.command(dom, "nbd-server-start", addr={  # SocketAddressLegacy
                "type": "inet", "data": {"host": address, "port": str(port)}}, **extra)
            return port
        except LibvirtError as e:
            last = str(e)
            if "already running" in last:
                raise Skipped(f"the QEMU already runs an NBD server: {last}") from None
    raise Skipped(f"no NBD server on {address}: {last}")


def _add_export(dom: Any, name: str, node: str) -> None:
    """A read-only export of ``node``. ``allow-inactive``: an export without it
    activates the node, and the paused incoming guest's nodes are not to be changed
    before it runs (QEMU activates them at ``cont``); a QEMU before 10.0 has no such
    option (and no inactive exports): then without it."""
    args: dict[str, Any] = {"type": "nbd", "id": name, "node-name": node, "name": name,
                            "writable": False}
    try:
        qmp.command(dom, "block-export-add", **args, **{"allow-inactive": True})
        return
    except LibvirtError as e:
        if "allow-inactive" not in str(e):
            raise Skipped(f"block-export-add {node}: {e}") from None
    try:
        qmp.command(dom, "block-export-add", **args)
    except LibvirtError as e:
        raise Skipped(f"block-export-add {node}: {e}") from None


def reader_xml(domain_xml: str, targets: tuple[str, ...], name: str) -> str:
    """A domain that only opens the copied images read-only: the source domain's
    emulator, machine type, features and firmware directories (``-L``), its copied
    disks with
    their drivers and targets; no kernel, no NIC, started paused and never run."""
    src = ET.fromstring(domain_xml)
    qns = "http://libvirt.org/schemas/domain/qemu/1.0"
    ET.register_namespace("qemu", qns)
    dom = ET.Element("domain", {"type": src.get("type", "qemu")})
    ET.SubElement(dom, "name").text = name
    ET.SubElement(dom, "memory", {"unit": "MiB"}).text = str(READER_MEMORY_MIB)
    ET.SubElement(dom, "vcpu").text = "1"
    os_el = ET.SubElement(dom, "os")
    t = src.find("./os/type")
    typ = ET.SubElement(os_el, "type", {k: v for k, v in (t.attrib if t is not None
                                                           else {}).items()
                                        if k in ("arch", "machine")})
    typ.text = "hvm"
    features = src.find("./features")
    if features is not None:  # as the source (an emulator without -no-acpi needs <acpi/>)
        dom.append(features)
    devices = ET.SubElement(dom, "devices")
    em = src.find("./devices/emulator")
    if em is not None:
        ET.SubElement(devices, "emulator").text = em.text
    for disk in src.findall("./devices/disk"):
        tgt = disk.find("target")
        if tgt is None or tgt.get("dev") not in targets:
            continue
        d = ET.SubElement(devices, "disk", {"type": disk.get("type", "file"),
                                            "device": "disk"})
        for child in ("driver", "source", "target"):
            el = disk.find(child)
            if el is not None:
                ET.SubElement(d, child, dict(el.attrib))
        ET.SubElement(d, "readonly")
    ET.SubElement(devices, "memballoon", {"model": "none"})
    args = [a.get("value", "") for a in src.findall(f"./{{{qns}}}commandline/{{{qns}}}arg")]
    fw = [v for i, v in enumerate(args) if i > 0 and args[i - 1] == "-L"]
    if fw:
        cl = ET.SubElement(dom, f"{{{qns}}}commandline")
        for v in fw:
            ET.SubElement(cl, f"{{{qns}}}arg", {"value": "-L"})
            ET.SubElement(cl, f"{{{qns}}}arg", {"value": v})
    return ET.tostring(dom, encoding="unicode")


@contextlib.contextmanager
def reader_domain(conn: Any, domain_xml: str, targets: tuple[str, ...],
                  domain: str) -> Iterator[Any]:
    """The source host's reader QEMU (paused, auto-destroyed); destroyed afterwards."""
    lv = libvirt_module()
    name = f"livemig-diskread-{domain}-{uuid.uuid4().hex[:6]}"
    try:
        dom = conn.createXML(reader_xml(domain_xml, targets, name),
                             lv.VIR_DOMAIN_START_PAUSED | lv.VIR_DOMAIN_START_AUTODESTROY)
    except lv.libvirtError as e:
        raise Skipped(f"the source host could not start a reader QEMU for the source's "
                      f"images: {message(e)}") from None
    try:
        yield dom
    finally:
        with contextlib.suppress(lv.libvirtError):
            dom.destroy()


def flip_byte(dom: Any, alias: str, node: str, reader: nbd.NbdReader, offset: int) -> None:
    """Testing only: invert one guest-visible byte of the destination's disk through
    its QEMU (HMP ``qemu-io``), after activating the node if the paused guest's is
    inactive."""
    if not 0 <= offset < reader.size:
        raise LivemigError(f"--inject-fault disk-byte@{offset:#x} is beyond the "
                           f"destination's disk ({reader.size} bytes)")
    old = reader.read(offset, 1)[0]
    with contextlib.suppress(LivemigError):  # absent before QEMU 10: nodes are active
        qmp.command(dom, "blockdev-set-active", **{"node-name": node, "active": True})
    # the device's own backend (its QOM path: a virtio disk's is .../virtio-backend);
    # a second writer on the node would need the device to share write permission
    _node, qdev = _block_of(dom, alias)
    out = qmp.command(dom, "human-monitor-command", **{
        "command-line": f'qemu-io -d {qdev} "write -P {old ^ 0xFF:#x} {offset} 1"'})
    # qemu-io prints to QEMU's stdout, not the reply: read the byte back to know
    if reader.read(offset, 1)[0] != old ^ 0xFF:
        raise LivemigError(f"--inject-fault disk-byte@{offset:#x}: qemu-io in the "
                           f"destination's QEMU did not write it ({str(out).strip()!r})")


def compare(src: Side, dst: Side, dst_dom: Any, domain_xml: str, domain: str,
            disks: dict[str, str], fault: int | None,
            event: Callable[..., None]) -> dict[str, dict[str, Any]]:
    """Each copied disk (target -> path): ``ok``, ``mismatch`` with the differing
    blocks, or ``skipped`` with why. ``fault``: flip that byte of the first disk on
    the destination first (testing)."""
    targets = tuple(disks)
    dst_alias = aliases(dst_dom)
    dst_nodes = {t: node_of(dst_dom, dst_alias.get(t, "")) for t in targets}
    with reader_domain(src.conn, domain_xml, targets, domain) as reader:
        src_alias = aliases(reader)
        src_nodes = {t: node_of(reader, src_alias.get(t, "")) for t in targets}
        with exports(reader, src, src_nodes) as src_port, \
                exports(dst_dom, dst, dst_nodes) as dst_port:
            event("disk exports", source=f"{src.address}:{src_port}",
                  destination=f"{dst.address}:{dst_port}", reader=reader.name(),
                  tls=src.tls)
            out: dict[str, dict[str, Any]] = {}
            for i, t in enumerate(targets):
                name = f"{EXPORT_PREFIX}{t}"
                with nbd.opened(src.connector(src_port), name, src.client_tls(),
                                src.address) as a, \
                        nbd.opened(dst.connector(dst_port), name, dst.client_tls(),
                                   dst.address) as b:
                    if fault is not None and i == 0:
                        flip_byte(dst_dom, dst_alias[t], dst_nodes[t], b, fault)
                        event("fault injected", kind="disk-byte", offset=f"{fault:#x}",
                              image=f"{disks[t]} on {dst.uri} (qemu-io in its QEMU)")
                    out[t] = {"source": f"{src.uri} {disks[t]}",
                              "destination": f"{dst.uri} {disks[t]}",
                              **compare_exports(a, b)}
    return out


def compare_exports(a: nbd.NbdReader, b: nbd.NbdReader) -> dict[str, Any]:
    """Digest both exports at once, compare; on a difference name the blocks and
    the first differing byte."""
    t0 = time.monotonic()

    def timed(r: nbd.NbdReader) -> tuple[Digests, float]:
        t = time.monotonic()
        return r.digests(CHUNK), time.monotonic() - t

    with ThreadPoolExecutor(2, thread_name_prefix="nbd-digest") as ex:
        fa, fb = ex.submit(timed, a), ex.submit(timed, b)
        (da, ta), (db, tb) = fa.result(), fb.result()
    res = cost(da.size, ta, tb, time.monotonic() - t0)
    diff = diff_chunks(da, db)
    if diff.equal:
        return {"result": "ok", **res}
    out: dict[str, Any] = {"result": "mismatch", **res, "chunks": diff.chunks,
                           "mismatched_chunks": len(diff.differing),
                           "first_mismatched_chunks": [f"{i * CHUNK:#x}" for i in
                                                       diff.differing[:MAX_LISTED]]}
    if da.size != db.size:
        out["sizes"] = {"source": da.size, "destination": db.size}
    first = diff.first
    if first is None:
        out["first_differing_byte"] = f"{min(da.size, db.size):#x}"
        return out
    start, end = chunk_range(first, CHUNK, max(da.size, db.size))
    byte = first_differing_byte(a.read(start, end - start), b.read(start, end - start))
    out["first_differing_chunk"] = {"index": first, "range": [f"{start:#x}", f"{end:#x}"]}
    out["first_differing_byte"] = None if byte is None else f"{start + byte:#x}"
    return out


def cost(size: int, src_s: float, dst_s: float, wall_s: float) -> dict[str, Any]:
    return volumes.cost(size, src_s, dst_s, wall_s, METHOD)
