"""Which TLS credentials a migration uses: the host's own PKI first, livemig's last.

A credentials directory is in QEMU's ``tls-creds-x509`` layout (see
:mod:`livemig.tls.pki`). Looked for, in order: the directory the user named
(``--tls-dir``), QEMU's and libvirt's standard locations for migration
(``/etc/pki/qemu``, then ``/etc/pki/libvirt-migrate``), then livemig's own PKI
(``livemig pki init``, default :data:`DEFAULT_DIR`, one subdirectory per host).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from livemig.errors import UsageError

# libvirt's migrate_tls_x509_cert_dir falls back to default_tls_x509_cert_dir, which
# is /etc/pki/qemu; /etc/pki/libvirt-migrate is the one its docs name for migration
STANDARD_DIRS = (Path("/etc/pki/qemu"), Path("/etc/pki/libvirt-migrate"))
DEFAULT_DIR = Path("/etc/pki/livemig")
SERVER_FILES = ("ca-cert.pem", "server-cert.pem", "server-key.pem")
CLIENT_FILES = ("ca-cert.pem", "client-cert.pem", "client-key.pem")


@dataclass(frozen=True)
class Tls:
    """TLS for one migration: what each end loads and whom the destination accepts.

    ``src_dir`` holds the source's client certificate, ``dst_dir`` the
    destination's server certificate; ``peer`` is the distinguished name of the
    source's client certificate, the only identity the destination's ``tls-authz``
    lets in; ``hostname`` the name the source checks the server certificate against
    (empty: the host of the migration URI)."""

    src_dir: Path
    dst_dir: Path
    peer: str
    hostname: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"src_dir": str(self.src_dir), "dst_dir": str(self.dst_dir),
                "peer": self.peer, "hostname": self.hostname}


def missing(directory: Path, files: tuple[str, ...]) -> list[str]:
    return [f for f in files if not (directory / f).is_file()]


def has_creds(directory: Path) -> bool:
    return not missing(directory, SERVER_FILES + CLIENT_FILES)


def find_dir(given: Path | None, host: str | None = None) -> Path | None:
    """The first directory that has a full set: ``given`` (must), the standard ones,
    then ``DEFAULT_DIR/<host>``."""
    if given is not None:
        lacking = missing(given, SERVER_FILES + CLIENT_FILES)
        if lacking:
            raise UsageError(f"--tls-dir {given}: missing {', '.join(lacking)} "
                             "(create them with: livemig pki init --dir DIR --host NAME)")
        return given
    for d in STANDARD_DIRS:
        if has_creds(d):
            return d
    if host is not None and has_creds(DEFAULT_DIR / host):
        return DEFAULT_DIR / host
    return None


def dn_string(name: Any) -> str:
    """A distinguished name as gnutls prints it (``gnutls_x509_crt_get_dn``), which
    is what QEMU's ``tls-authz`` and libvirt's ``tls_allowed_dn_list`` compare:
    RFC 4514 escaping, but the RDNs in the certificate's order (``O=...,CN=...``),
    not RFC 4514's reversed one (seen in QEMU 10.2 with gnutls 3.7's "authz check
    for O=livemig,CN=src is denied")."""
    return ",".join(rdn.rfc4514_string() for rdn in name.rdns)


def client_identity(directory: Path) -> str:
    """The distinguished name of ``directory``'s client certificate, as QEMU's
    ``tls-authz`` compares it."""
    from cryptography import x509

    path = directory / "client-cert.pem"
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the client certificate: {e}") from None
    return dn_string(cert.subject)


def uri_host(uri: str) -> str | None:
    """The host of a ``tcp:HOST:PORT`` URI (None for unix:)."""
    if not uri.startswith("tcp:"):
        return None
    host = uri[4:].rsplit(":", 1)[0]
    return host.strip("[]")


def is_local(host: str | None) -> bool:
    """A loopback address or name (or a unix socket: None)."""
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MODES = ("auto", "on", "off")


def enabled(mode: str, one_host: bool) -> bool:
    """``--tls``: on, off, or auto = on unless both ends are on this one host."""
    if mode not in MODES:
        raise UsageError(f"bad --tls {mode!r}: choose from {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and not one_host)


def attach_tls(mode: str, given: Path | None, uri: str) -> Tls | None:
    """TLS for an attach run, from ``--tls``, ``--tls-dir`` and ``--uri``.

    Both QMP sockets are local, so each QEMU reads the directory on its own host:
    with the standard locations, each host's own certificates. The accepted peer is
    this host's client certificate (the source QEMU runs where its QMP socket is)."""
    if not enabled(mode, one_host=is_local(uri_host(uri))):
        return None
    import socket

    directory = find_dir(given, socket.gethostname())
    if directory is None:
        raise UsageError(
            f"--tls {mode}: no TLS credentials in {', '.join(map(str, STANDARD_DIRS))} "
            f"or {DEFAULT_DIR}/HOST: create them (livemig pki init --host NAME=ADDRESS,"
            "... and copy each host's directory to /etc/pki/qemu), give --tls-dir, or "
            "--tls off")
    return Tls(src_dir=directory, dst_dir=directory, peer=client_identity(directory))


def libvirt_one_host(src_uri: str, dst_uri: str) -> bool:
    """Whether two libvirt URIs name daemons on one host: both without a host
    (``qemu:///system``, ``qemu+unix://``) or with the same host name."""
    from urllib.parse import urlsplit

    a, b = urlsplit(src_uri).hostname, urlsplit(dst_uri).hostname
    return a == b or (is_local(a) and is_local(b))
