"""The NBD reader against a scripted NBD server (the protocol's newstyle handshake,
NBD_OPT_GO and simple read replies), and the copied-disk comparison over two
exports: equal, one byte differing (named), a refused export, a reader domain's XML."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from livemig.virt import diskcheck, nbd

MIB = 1 << 20


def _serve(sock: socket.socket, exports: dict[str, bytes], read_errno: int = 0,
           tls: ssl.SSLContext | None = None) -> None:
    """One client: the fixed newstyle handshake (STARTTLS first with ``tls``),
    NBD_OPT_GO, reads, disconnect."""
    try:
        sock.sendall(struct.pack(">QQH", nbd.NBDMAGIC, nbd.IHAVEOPT,
                                 nbd.FLAG_FIXED_NEWSTYLE | nbd.FLAG_NO_ZEROES))
        nbd._recv(sock, 4)
        magic, opt, length = struct.unpack(">QII", nbd._recv(sock, 16))
        if tls is not None:
            assert opt == nbd.OPT_STARTTLS and length == 0
            sock.sendall(struct.pack(">QIII", nbd.REPLY_MAGIC, opt, nbd.REP_ACK, 0))
            sock = tls.wrap_socket(sock, server_side=True)
            magic, opt, length = struct.unpack(">QII", nbd._recv(sock, 16))
        data = nbd._recv(sock, length)
        assert magic == nbd.IHAVEOPT and opt == nbd.OPT_GO
        (n,) = struct.unpack(">I", data[:4])
        name = data[4:4 + n].decode()
        if name not in exports:
            msg = b"export not found"
            sock.sendall(struct.pack(">QIII", nbd.REPLY_MAGIC, opt, nbd.REP_ERR_BIT | 6,
                                     len(msg)) + msg)
            return
        image = exports[name]
        info = struct.pack(">HQH", nbd.INFO_EXPORT, len(image), 1)
        sock.sendall(struct.pack(">QIII", nbd.REPLY_MAGIC, opt, nbd.REP_INFO, len(info))
                     + info)
        sock.sendall(struct.pack(">QIII", nbd.REPLY_MAGIC, opt, nbd.REP_ACK, 0))
        while True:
            magic, _f, typ, handle, off, ln = struct.unpack(">IHHQQI", nbd._recv(sock, 28))
            if typ == nbd.CMD_DISC:
                return
            assert typ == nbd.CMD_READ
            sock.sendall(struct.pack(">IIQ", nbd.SIMPLE_REPLY_MAGIC, read_errno, handle))
            if not read_errno:
                sock.sendall(image[off:off + ln])
    except (nbd.NbdError, OSError, ssl.SSLError):
        return
    finally:
        sock.close()


def _connector(exports: dict[str, bytes], read_errno: int = 0,  # type: ignore[no-untyped-def]
               tls: ssl.SSLContext | None = None):
    def connect() -> socket.socket:
        a, b = socket.socketpair()
        threading.Thread(target=_serve, args=(b, exports, read_errno, tls),
                         daemon=True).start()
        return a
    return connect


@pytest.fixture
def image() -> bytes:
    return bytes((i * 7) & 0xFF for i in range(3 * MIB + 4096))


def test_reads_an_export_and_digests_it(image: bytes) -> None:
    with nbd.opened(_connector({"x": image}), "x") as r:
        assert r.size == len(image)
        assert r.read(MIB - 3, 10) == image[MIB - 3:MIB + 7]
        assert r.read(len(image) - 2, 100) == image[-2:]  # clipped at the end
        d = r.digests()
    assert d.size == len(image) and len(d.digests) == 4


def test_unknown_export_and_failed_read_are_one_line_errors(image: bytes) -> None:
    with pytest.raises(nbd.NbdError, match="export 'y': export not found"), \
            nbd.opened(_connector({"x": image}), "y"):
        pass
    with nbd.opened(_connector({"x": image}, read_errno=5), "x") as r, \
            pytest.raises(nbd.NbdError, match="read at 0x0 failed"):
        r.read(0, 10)


def test_not_an_nbd_server_is_refused() -> None:
    def connect() -> socket.socket:
        a, b = socket.socketpair()
        b.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
        b.close()
        return a
    with pytest.raises(nbd.NbdError, match="not a newstyle NBD server"), \
            nbd.opened(connect, "x"):
        pass


def _server_tls(d: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "server-cert.pem", d / "server-key.pem")
    ctx.load_verify_locations(d / "ca-cert.pem")
    ctx.verify_mode = ssl.CERT_REQUIRED  # QEMU's verify-peer=true
    return ctx


def test_tls_export_needs_the_same_pki(image: bytes, tmp_path: Path) -> None:
    """STARTTLS before NBD_OPT_GO; the server's certificate is checked against the
    address, the client shows its own; another PKI's client is refused."""
    from livemig.tls import pki

    host = pki.HostSpec("h", (), ("127.0.0.1",))
    (d,) = pki.init(tmp_path / "a", [host])
    (other,) = pki.init(tmp_path / "b", [host])
    with nbd.opened(_connector({"x": image}, tls=_server_tls(d)), "x",
                    nbd.client_tls(d), "127.0.0.1") as r:
        assert r.read(MIB, 8) == image[MIB:MIB + 8]
    with pytest.raises(nbd.NbdError, match="TLS with the NBD server failed"), \
            nbd.opened(_connector({"x": image}, tls=_server_tls(d)), "x",
                       nbd.client_tls(other), "127.0.0.1"):
        pass
    with pytest.raises(nbd.NbdError, match="TLS credentials in"):
        nbd.client_tls(tmp_path)


@pytest.fixture
def two(image: bytes) -> Iterator[tuple[bytes, bytearray]]:
    yield image, bytearray(image)


def _compare(a: bytes, b: bytes) -> dict[str, object]:
    with nbd.opened(_connector({"e": a}), "e") as ra, \
            nbd.opened(_connector({"e": bytes(b)}), "e") as rb:
        return diskcheck.compare_exports(ra, rb)


def test_equal_exports_are_ok_with_their_cost(two: tuple[bytes, bytearray]) -> None:
    a, b = two
    res = _compare(a, b)
    assert res["result"] == "ok" and res["bytes"] == len(a)
    assert res["chunk_size"] == MIB and res["method"] == diskcheck.METHOD
    assert "first_differing_byte" not in res


def test_one_differing_byte_is_named(two: tuple[bytes, bytearray]) -> None:
    a, b = two
    b[2 * MIB + 0x1234] ^= 0xFF
    res = _compare(a, b)
    assert res["result"] == "mismatch"
    assert res["mismatched_chunks"] == 1
    assert res["first_mismatched_chunks"] == [f"{2 * MIB:#x}"]
    assert res["first_differing_chunk"] == {"index": 2,
                                            "range": [f"{2 * MIB:#x}", f"{3 * MIB:#x}"]}
    assert res["first_differing_byte"] == f"{2 * MIB + 0x1234:#x}"


def test_a_shorter_destination_differs_where_it_ends(two: tuple[bytes, bytearray]) -> None:
    a, b = two
    res = _compare(a, b[:2 * MIB])
    assert res["result"] == "mismatch"
    assert res["sizes"] == {"source": len(a), "destination": 2 * MIB}


SOURCE_XML = """<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>g</name><memory unit='MiB'>256</memory>
  <os><type arch='x86_64' machine='q35'>hvm</type><kernel>/k</kernel></os>
  <features><acpi/></features>
  <devices><emulator>/usr/bin/qemu</emulator>
    <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
      <source file='/img/a.qcow2'/><target dev='vda' bus='virtio'/></disk>
    <disk type='file' device='disk'><driver name='qemu' type='raw'/>
      <source file='/img/shared.img'/><target dev='vdb' bus='virtio'/></disk>
    <interface type='bridge'><source bridge='br0'/></interface>
  </devices>
  <qemu:commandline><qemu:arg value='-L'/><qemu:arg value='/fw'/>
    <qemu:arg value='-global'/><qemu:arg value='x.y=1'/></qemu:commandline>
</domain>"""


def test_the_reader_domain_only_opens_the_copied_images_read_only() -> None:
    xml = diskcheck.reader_xml(SOURCE_XML, ("vda",), "livemig-diskread-g-1")
    d = ET.fromstring(xml)
    assert d.findtext("name") == "livemig-diskread-g-1"
    assert d.find("./os/kernel") is None and d.find("./devices/interface") is None
    assert d.find("./os/type").get("machine") == "q35"  # type: ignore[union-attr]
    assert d.findtext("./devices/emulator") == "/usr/bin/qemu"
    assert d.find("./features/acpi") is not None
    disks = d.findall("./devices/disk")
    assert len(disks) == 1 and disks[0].find("readonly") is not None
    assert disks[0].find("driver").get("type") == "qcow2"  # type: ignore[union-attr]
    assert disks[0].find("source").get("file") == "/img/a.qcow2"  # type: ignore[union-attr]
    qns = "{http://libvirt.org/schemas/domain/qemu/1.0}"
    args = [a.get("value") for a in d.findall(f"./{qns}commandline/{qns}arg")]
    assert args == ["-L", "/fw"]  # the firmware directories, nothing else
