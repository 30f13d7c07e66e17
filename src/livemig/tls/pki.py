"""A small x509 PKI for hosts that have none: one CA, per-host server and client
certificates, in the layout QEMU's ``tls-creds-x509`` reads.

``DIR/ca-cert.pem`` and ``DIR/ca-key.pem`` are the CA; each host gets
``DIR/<host>/`` with ``ca-cert.pem``, ``server-cert.pem``, ``server-key.pem``,
``client-cert.pem``, ``client-key.pem`` (QEMU's names; libvirt's ``/etc/pki/qemu`` is
the same layout), and symlinks with libvirt's client/daemon names (``cacert.pem``,
``clientcert.pem``, ...) so that the directory also serves as a libvirt
``?pkipath=``. Keys are written 0600 and exclusively (never through a file another
user created first). An existing CA in ``DIR`` is reused, so hosts can be added later.

The Python ``cryptography`` package does the work (not gnutls' ``certtool``): it is a
pip dependency like the others, needs no Debian package or template files, and the
unit tests verify the chain with the same library.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from livemig.errors import UsageError

ORG = "livemig"
# ten years: a lab or a small site should not meet an expired CA; users with policies
# of their own bring their own PKI (found first, see livemig.tls.creds)
VALID_DAYS = 3650
# P-256 ECDSA: what every gnutls/openssl in use accepts, and fast for the handshake
# (the stream itself is AES-GCM whatever the key type)
_CURVE = ec.SECP256R1()
QEMU_FILES = ("ca-cert.pem", "server-cert.pem", "server-key.pem", "client-cert.pem",
              "client-key.pem")
# libvirt's names for the same files (a client's ``?pkipath=DIR``, libvirtd's
# key_file/cert_file/ca_file): symlinks, so one directory serves QEMU and libvirt
LIBVIRT_LINKS = {"cacert.pem": "ca-cert.pem", "servercert.pem": "server-cert.pem",
                 "serverkey.pem": "server-key.pem", "clientcert.pem": "client-cert.pem",
                 "clientkey.pem": "client-key.pem"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,62}$")


@dataclass(frozen=True)
class HostSpec:
    """One host: the directory name and common name, and its subject alt names."""

    name: str
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()


def parse_hosts(text: str) -> list[HostSpec]:
    """``NAME[=ALT+ALT...][,NAME...]``: each name is a DNS name or an IP address;
    alternative names after ``=`` are joined with ``+`` (e.g. ``lm-src=10.77.0.1``)."""
    hosts = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, alts = item.partition("=")
        names = [name, *[a for a in alts.split("+") if a]]
        dns: list[str] = []
        ips: list[str] = []
        for n in names:
            try:
                ips.append(str(ipaddress.ip_address(n)))
            except ValueError:
                if not _NAME.match(n):
                    raise UsageError(f"bad --host name {n!r}: letters, digits, '.', '-' "
                                     "or an IP address") from None
                dns.append(n)
        hosts.append(HostSpec(name, tuple(dns), tuple(ips)))
    if not hosts:
        raise UsageError("--host: give at least one host name")
    return hosts


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively with ``mode`` (replacing a file of ours)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca-cert.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise UsageError(f"{key_path}: not a CA key livemig made (EC P-256)")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(_CURVE)
    name = subject(f"livemig CA {os.uname().nodename}")
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                         False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, _cert_pem(cert), 0o644)
    return cert, key


def _leaf(host: HostSpec, role: str, ca: x509.Certificate,
          ca_key: ec.EllipticCurvePrivateKey) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(_CURVE)
    alt: list[x509.GeneralName] = [x509.DNSName(d) for d in host.dns]
    alt += [x509.IPAddress(ipaddress.ip_address(i)) for i in host.ips]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" \
        else ExtendedKeyUsageOID.CLIENT_AUTH
    now = _now()
    b = (x509.CertificateBuilder().subject_name(subject(host.name))
         .issuer_name(ca.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(True, False, True, False, False, False, False,
                                      False, False), critical=True)
         .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
             ca_key.public_key()), critical=False))
    if alt:
        b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    return _cert_pem(b.sign(ca_key, hashes.SHA256())), _key_pem(key)


def init(directory: Path, hosts: list[HostSpec]) -> list[Path]:
    """The CA in ``directory`` (made or reused) and a fresh set of host credentials
    in ``directory/<host>/`` for each host; returns the host directories."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    ca, ca_key = _ca(directory)
    out = []
    for host in hosts:
        d = directory / host.name
        d.mkdir(exist_ok=True, mode=0o755)
        _write(d / "ca-cert.pem", _cert_pem(ca), 0o644)
        for role in ("server", "client"):
            cert, key = _leaf(host, role, ca, ca_key)
            _write(d / f"{role}-key.pem", key, 0o600)
            _write(d / f"{role}-cert.pem", cert, 0o644)
        for link, target in LIBVIRT_LINKS.items():
            if not (d / link).is_symlink():
                (d / link).symlink_to(target)
        out.append(d)
    return out
