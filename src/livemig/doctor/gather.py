"""The facts about one host: from its libvirt daemon, and, when its files are
visible from here (this machine, or one of the testbed's hosts), from its emulator,
its ``qemu.conf`` and ``/dev/kvm``; a remote host's emulator through a paused probe
domain its daemon starts (:mod:`livemig.doctor.remote`)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from livemig.accel import kvm_usable
from livemig.doctor.facts import HostFacts, QemuFacts
from livemig.doctor.probe import probe
from livemig.doctor.remote import probe_remote
from livemig.install import apparmor
from livemig.tls.creds import CLIENT_FILES, SERVER_FILES, is_local, missing
from livemig.virt.conn import libvirt_module, message, open_uri, testbed_side

QEMU_CONF = "/etc/libvirt/qemu.conf"
# libvirt's default for migrate_tls_x509_cert_dir, through default_tls_x509_cert_dir
DEFAULT_TLS_DIR = "/etc/pki/qemu"
ARCH = "x86_64"


def local_config(uri: str) -> Path | None:
    """Where the daemon behind ``uri`` keeps its ``qemu.conf`` as seen from here, or
    None when it runs on another machine."""
    from livemig.testbed import libvirtd

    side = testbed_side(uri)
    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    socket = (parse_qs(parts.query).get("socket") or [""])[0]
    for s in libvirtd.ALL_SIDES:  # the testbed's daemons by their UNIX socket too
        if socket and Path(socket).is_relative_to(libvirtd.host_dir(s)):
            side = s
    if side is not None:
        return libvirtd.host_view(side, QEMU_CONF)
    if is_local(parts.hostname):
        return Path(QEMU_CONF)
    return None


def conf_value(text: str, key: str) -> str | None:
    m = re.search(rf'^\s*{re.escape(key)}\s*=\s*"([^"]*)"', text, re.MULTILINE)
    return m.group(1) if m else None


def tls_dir(conf: Path) -> str:
    """The daemon's migration certificates: ``migrate_tls_x509_cert_dir``, else
    ``default_tls_x509_cert_dir``, else libvirt's default."""
    try:
        text = conf.read_text()
    except OSError:
        text = ""
    return (conf_value(text, "migrate_tls_x509_cert_dir")
            or conf_value(text, "default_tls_x509_cert_dir") or DEFAULT_TLS_DIR)


def confinement(conf: Path, emulator: str | None,
                root: Path = Path("/")) -> tuple[bool, bool | None]:
    """(confined, allowed): whether libvirt confines QEMU with AppArmor on this host
    (kernel on, libvirt's profiles installed, ``security_driver`` not ``none``) and,
    if so, whether its abstraction or a drop-in names ``emulator``."""
    try:
        text = conf.read_text()
    except OSError:
        text = ""
    if conf_value(text, "security_driver") == "none" or not apparmor.applies(root) or \
            (root == Path("/") and not apparmor.kernel_enabled()):
        return False, None
    if emulator is None:
        return True, None
    rules = [root / apparmor.ABSTRACTION]
    d = root / apparmor.DOMAIN_DROPIN_DIR
    rules += sorted(d.iterdir()) if d.is_dir() else []
    pat = re.compile(rf'^\s*"?{re.escape(emulator)}"?\s+[a-zA-Z]*x', re.MULTILINE)
    for r in rules:
        try:
            if pat.search(r.read_text()):
                return True, True
        except OSError:
            continue
    return True, False


def _domcaps(conn: Any, emulator: str | None, virttype: str) -> tuple[str | None, str | None]:
    """(emulator path, error) from libvirt's domain capabilities."""
    libvirt = libvirt_module()
    try:
        xml = conn.getDomainCapabilities(emulator, ARCH, None, virttype, 0)
    except libvirt.libvirtError as e:
        return emulator, message(e)
    path = ET.fromstring(xml).findtext("path")
    return (path or emulator), None


def _call(f: Any) -> Any:
    libvirt = libvirt_module()
    try:
        return f()
    except libvirt.libvirtError:
        return None


def gather(uri: str, emulator: Path | None, tls_required: bool,
           remote: bool | None = None) -> HostFacts:
    """Everything :func:`livemig.doctor.checks.check` needs; a one-line error only when
    the daemon cannot be reached at all. ``remote``: treat the host as one whose files
    are not visible from here (None: find out from the URI)."""
    libvirt = libvirt_module()
    conn = open_uri(uri, "host")
    try:
        given = str(emulator) if emulator is not None else None
        path, err = _domcaps(conn, given, "qemu")
        kpath, kerr = _domcaps(conn, given, "kvm")
        if given is None and path is None:
            path, err = kpath, kerr
        conf = None if remote else local_config(uri)
        local = conf is not None
        qemu: QemuFacts | None = None
        if local and path is not None:
            qemu = probe(Path(path))
        elif path is not None:
            qemu = probe_remote(conn, path)
        tdir = tls_dir(conf) if conf is not None else None
        lacking = tuple(missing(Path(tdir), tuple(dict.fromkeys(SERVER_FILES + CLIENT_FILES)))
                        ) if tdir is not None else None
        confined, allows = confinement(conf, path) if conf is not None else (None, None)
        info = _call(conn.getInfo)
        free = _call(conn.getFreeMemory)
        doms = _call(lambda: conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE))
        return HostFacts(
            uri=uri, hostname=_call(conn.getHostname), libvirt_version=_call(
                conn.getLibVersion), hypervisor_version=_call(conn.getVersion),
            emulator=path, emulator_given=given is not None, domcaps_error=err,
            libvirt_kvm=kerr is None, local=local,
            kvm_problem=kvm_usable() if local else None, qemu=qemu,
            tls_required=tls_required, tls_dir=tdir, tls_missing=lacking,
            free_memory=int(free) if free is not None else None,
            total_memory=int(info[1]) << 20 if info else None,
            running=len(doms) if doms is not None else None, confined=confined,
            confinement_allows=allows)
    finally:
        _call(conn.close)
