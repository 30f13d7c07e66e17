"""A minimal read-only NBD client: what the copied-disk comparison reads exports with.

Only what reading a QEMU export needs (the NBD protocol, ``doc/proto.md`` of the
NBD project): the fixed newstyle handshake, ``NBD_OPT_GO`` for one named export
(its size comes back in ``NBD_INFO_EXPORT``), simple replies to ``NBD_CMD_READ``,
and ``NBD_CMD_DISC`` at the end; ``NBD_OPT_STARTTLS`` first when given a TLS context
(x509: the server's certificate checked against the address, a client certificate
shown). No structured replies, no writes. An export of a
QEMU block node serves the guest-visible data, so a qcow2 image reads the same as
a raw one. The socket is made by the caller (inside a testbed host's namespace, or
over the migration network).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from livemig.errors import LivemigError
from livemig.virt.chunks import CHUNK, ChunkHasher, Digests

NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2
OPT_STARTTLS = 5
OPT_GO = 7
REP_ACK = 1
REP_INFO = 3
REP_ERR_BIT = 1 << 31
INFO_EXPORT = 0
CMD_READ = 0
CMD_DISC = 2
READ_SIZE = CHUNK  # bytes per read request: QEMU serves up to 32 MiB per request
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # one request; a loaded host's image read is far below this


class NbdError(LivemigError):
    """The NBD server refused or broke the protocol (one line)."""


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise NbdError(f"the NBD server closed the connection ({len(buf)} of {n} bytes)")
        buf.extend(got)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise NbdError("the NBD server closed the connection mid-read")
        view = view[n:]


class NbdReader:
    """One export opened read-only: ``size`` and ``read(offset, length)``."""

    def __init__(self, sock: socket.socket, export: str, tls: ssl.SSLContext | None = None,
                 hostname: str | None = None) -> None:
        self.sock = sock
        self.export = export
        self._handle = 0
        self.size = self._handshake(tls, hostname)

    def _handshake(self, tls: ssl.SSLContext | None, hostname: str | None) -> int:
        magic, opt, flags = struct.unpack(">QQH", _recv(self.sock, 18))
        if magic != NBDMAGIC or opt != IHAVEOPT:
            raise NbdError("not a newstyle NBD server")
        if not flags & FLAG_FIXED_NEWSTYLE:
            raise NbdError("the NBD server does not speak fixed newstyle")
        self.sock.sendall(struct.pack(">I", flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)))
        if tls is not None:
            self.sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_STARTTLS, 0))
            self._reply()
            try:
                self.sock = tls.wrap_socket(self.sock, server_hostname=hostname)
            except (ssl.SSLError, OSError) as e:
                raise NbdError(f"TLS with the NBD server failed: {e}") from None
        name = self.export.encode()
        data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
        self.sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
        size: int | None = None
        while True:
            rep, payload = self._reply()
            if rep == REP_INFO and len(payload) >= 12:
                (kind,) = struct.unpack(">H", payload[:2])
                if kind == INFO_EXPORT:
                    size = struct.unpack(">Q", payload[2:10])[0]
            elif rep == REP_ACK:
                break
        if size is None:
            raise NbdError(f"export {self.export!r}: the server sent no size")
        return size

    def _reply(self) -> tuple[int, bytes]:
        """One option reply: its type and payload; an error reply raises."""
        magic, _opt, rep, length = struct.unpack(">QIII", _recv(self.sock, 20))
        if magic != REPLY_MAGIC:
            raise NbdError("bad NBD option reply")
        payload = _recv(self.sock, length)
        if rep & REP_ERR_BIT:
            text = payload.decode(errors="replace") or f"error {rep:#x}"
            raise NbdError(f"export {self.export!r}: {text}")
        return rep, payload

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (clipped at the end of the export)."""
        length = max(0, min(length, self.size - offset))
        out = bytearray(length)
        view = memoryview(out)
        pos = 0
        while pos < length:
            n = min(READ_SIZE, length - pos)
            self._read_into(offset + pos, view[pos:pos + n])
            pos += n
        return bytes(out)

    def _read_into(self, offset: int, view: memoryview) -> None:
        self._handle += 1
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, self._handle,
                                      offset, len(view)))
        magic, err, handle = struct.unpack(">IIQ", _recv(self.sock, 16))
        if magic != SIMPLE_REPLY_MAGIC or handle != self._handle:
            raise NbdError("bad NBD reply")
        if err:
            raise NbdError(f"export {self.export!r}: read at {offset:#x} failed "
                           f"(errno {err})")
        _recv_into(self.sock, view)

    def digests(self, chunk: int = CHUNK) -> Digests:
        """The export's SHA-256 per ``chunk``, read in order."""
        h = ChunkHasher(chunk)
        for off in range(0, self.size, READ_SIZE):
            h.data(self.read(off, READ_SIZE))
        return h.finish()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
        with contextlib.suppress(OSError):
            self.sock.close()


@contextlib.contextmanager
def opened(connect: Callable[[], socket.socket], export: str,
           tls: ssl.SSLContext | None = None, hostname: str | None = None
           ) -> Iterator[NbdReader]:
    """An export, read-only, closed afterwards; ``connect`` makes the socket; with
    ``tls`` the server's certificate must name ``hostname``."""
    try:
        sock = connect()
    except OSError as e:
        raise NbdError(f"cannot reach the NBD export {export!r}: {e}") from None
    try:
        r = NbdReader(sock, export, tls, hostname)
    except BaseException:
        sock.close()
        raise
    try:
        yield r
    finally:
        r.close()


def client_tls(directory: Path) -> ssl.SSLContext:
    """A client context from a directory in QEMU's x509 layout (``ca-cert.pem``,
    ``client-cert.pem``, ``client-key.pem``)."""
    try:
        ctx = ssl.create_default_context(cafile=str(directory / "ca-cert.pem"))
        ctx.load_cert_chain(directory / "client-cert.pem", directory / "client-key.pem")
    except (OSError, ssl.SSLError) as e:
        raise NbdError(f"TLS credentials in {directory}: {e}") from None
    return ctx


def tcp(host: str, port: int) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(READ_TIMEOUT_S)
        return sock
    return connect
