"""The PKI (livemig pki init) and the TLS objects on both ends (scripted QMP)."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from livemig.cli import main
from livemig.errors import UsageError
from livemig.tls import creds, pki


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_pki_certificates_verify_against_the_ca_with_the_right_sans(tmp_path: Path) -> None:
    dirs = pki.init(tmp_path, pki.parse_hosts("lm-src=10.77.0.1,lm-dst=10.77.0.2+dst.example"))
    ca = _cert(tmp_path / "ca-cert.pem")
    assert [d.name for d in dirs] == ["lm-src", "lm-dst"]
    for d in dirs:
        assert (d / "ca-cert.pem").read_bytes() == (tmp_path / "ca-cert.pem").read_bytes()
        for role, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH),
                            ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
            cert = _cert(d / f"{role}-cert.pem")
            cert.verify_directly_issued_by(ca)  # raises if not signed by the CA
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            assert list(eku) == [usage]
            assert stat.S_IMODE((d / f"{role}-key.pem").stat().st_mode) == 0o600
    san = _cert(tmp_path / "lm-dst" / "server-cert.pem").extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["lm-dst", "dst.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.77.0.2")]
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600
    assert creds.client_identity(tmp_path / "lm-src") == "O=livemig,CN=lm-src"


def test_pki_reuses_its_ca_and_a_foreign_ca_does_not_verify(tmp_path: Path) -> None:
    pki.init(tmp_path / "a", pki.parse_hosts("one"))
    ca_before = (tmp_path / "a" / "ca-cert.pem").read_bytes()
    pki.init(tmp_path / "a", pki.parse_hosts("two"))
    assert (tmp_path / "a" / "ca-cert.pem").read_bytes() == ca_before
    _cert(tmp_path / "a" / "two" / "client-cert.pem").verify_directly_issued_by(
        _cert(tmp_path / "a" / "ca-cert.pem"))
    pki.init(tmp_path / "b", pki.parse_hosts("one"))
    with pytest.raises((InvalidSignature, ValueError)):
        _cert(tmp_path / "b" / "one" / "client-cert.pem").verify_directly_issued_by(
            _cert(tmp_path / "a" / "ca-cert.pem"))


@pytest.mark.parametrize("text", ["", ",", "bad name", "-x", "a=b c"])
def test_pki_bad_host_names_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError):
        pki.parse_hosts(text)


def test_pki_init_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pki", "init", "--dir", str(tmp_path), "--host", "h1,h2=127.0.0.1"]) == 0
    assert creds.has_creds(tmp_path / "h1") and creds.has_creds(tmp_path / "h2")
    assert main(["pki", "init", "--dir", str(tmp_path), "--host", "no way"]) == 2
    assert "bad --host name" in capsys.readouterr().err


def test_find_dir_given_must_be_complete(tmp_path: Path) -> None:
    pki.init(tmp_path, pki.parse_hosts("h"))
    assert creds.find_dir(tmp_path / "h") == tmp_path / "h"
    (tmp_path / "h" / "client-key.pem").unlink()
    with pytest.raises(UsageError, match=r"missing client-key\.pem"):
        creds.find_dir(tmp_path / "h")


@pytest.mark.parametrize(("uri", "local"), [
    ("tcp:127.0.0.1:4444", True), ("tcp:localhost:4444", True), ("tcp:[::1]:4444", True),
    ("unix:/run/x.sock", True), ("tcp:10.77.0.2:4444", False), ("tcp:dst.example:1", False)])
def test_uri_locality(uri: str, local: bool) -> None:
    assert creds.is_local(creds.uri_host(uri)) is local
