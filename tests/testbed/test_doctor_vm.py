"""``livemig install-qemu`` and ``livemig doctor`` on the testbed's libvirt daemons:
the patched QEMU installed under a fresh prefix, checked by the doctor through the
destination daemon, and named as a domain's ``<emulator>`` with no ``-L`` (and its
NIC's option ROM on: the firmware links give it efi-virtio.rom, which ``-L`` of the
two Debian directories never did).

Marked ``testbed`` and ``libvirt`` like the other libvirt tests; the migration of
such a domain is ``long``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import INITRD, KERNEL, QEMU, livemig_cmd
from livemig import libvirt_lab
from livemig.testbed import libvirtd, netns, topology

pytestmark = [pytest.mark.testbed, pytest.mark.libvirt]
BOOT_TIMEOUT_S = 60.0  # an idle guest of this image answers ping ~5 s after start


def _install(prefix: Path, *extra: str) -> Iterator[Path]:
    r = subprocess.run(livemig_cmd("install-qemu", "--prefix", str(prefix),
                                   "--no-apparmor", *extra), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "a q35 machine starts with no -L" in r.stdout
    yield prefix / "bin" / "qemu-system-x86_64"
    subprocess.run(livemig_cmd("install-qemu", "--prefix", str(prefix), "--uninstall"),
                   capture_output=True, text=True, timeout=60, check=True)
    assert not (prefix / "bin").exists()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not QEMU.exists():
        pytest.skip("no patched build: make qemu")
    yield from _install(tmp_path_factory.mktemp("prefix") / "qemu")


@pytest.fixture(scope="module")
def installed_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The unpatched build of the same release, installed the same way (the raw build
    has no firmware beside it, so a daemon could not start it at all)."""
    if not (QEMU.parent.parent / "qemu-upstream" / "qemu-system-x86_64").exists():
        pytest.skip("no unpatched build: make qemu-upstream")
    yield from _install(tmp_path_factory.mktemp("prefix") / "qemu-upstream", "--upstream")


@pytest.fixture(scope="module")
def daemons() -> Iterator[None]:
    with libvirt_lab.testbed(None, owner="tests (doctor)"):
        yield


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(livemig_cmd("doctor", *args), capture_output=True, text=True,
                       timeout=120)
    print(r.stdout, r.stderr)
    return r


def test_doctor_passes_the_destination_and_fails_a_non_qemu(installed: Path,
                                                            daemons: None) -> None:
    r = _doctor(libvirtd.uri("dst"), "--emulator", str(installed))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {ln.split()[1]: ln.split()[0] for ln in r.stdout.splitlines()[:-1]}
    for what in ("libvirt", "emulator", "qemu", "mechanisms", "firmware", "apparmor", "tls",
                 "memory", "domains"):
        assert lines.get(what) == "ok", (what, r.stdout)
    assert "patched build" in r.stdout and "host can take part" in r.stdout
    bad = _doctor(libvirtd.uri("dst"), "--emulator", "/bin/true")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert re.search(r"^fail  (emulator|qemu) ", bad.stdout, re.MULTILINE), bad.stdout
    assert "host cannot take part" in bad.stdout
    # the build itself has no firmware links beside it: the doctor says so
    build = _doctor(libvirtd.uri("dst"), "--emulator", str(QEMU))
    assert re.search(r"^warn  firmware .*bios-256k\.bin", build.stdout, re.MULTILINE), \
        build.stdout


def test_a_remote_hosts_emulator_is_asked_through_a_paused_probe_domain(
        installed: Path, installed_upstream: Path, daemons: None) -> None:
    """As if dst's files were not visible from here: its daemon starts a paused probe
    domain of the emulator, whose QMP names the mechanisms; the probe leaves nothing."""
    from livemig.doctor.checks import check
    from livemig.doctor.gather import gather
    from livemig.doctor.remote import NAME_PREFIX

    def findings(emulator: Path) -> dict[str, tuple[str, str]]:
        f = gather(libvirtd.uri("dst"), emulator, True, remote=True)
        assert not f.local
        return {x.what: (x.level, x.detail) for x in check(f)}

    got = findings(installed)
    assert "mechanisms" in got, got
    assert got["mechanisms"][0] == "ok" and "page sampler" in got["mechanisms"][1], got
    assert got["firmware"][0] == "ok" and got["qemu"][0] == "ok", got
    stock = findings(installed_upstream)
    assert "mechanisms" in stock, stock
    assert stock["mechanisms"][0] == "warn" and "stock QEMU" in stock["mechanisms"][1], stock
    # the raw build has no firmware beside it: its machine cannot be built, said why
    raw = findings(QEMU)
    assert raw["qemu"][0] == "fail" and "bios" in raw["qemu"][1].lower(), raw
    c = libvirt_lab.conn("dst")
    try:
        assert not [d.name() for d in c.listAllDomains()
                    if d.name().startswith(NAME_PREFIX)]
    finally:
        c.close()


def _domain_xml(name: str, emulator: Path) -> str:
    from livemig.virt.domain import lab_domain_xml

    image = libvirtd.shared_dir() / f"{name}.img"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    xml = lab_domain_xml(name, emulator, KERNEL, INITRD, str(image), memory_mib=192)
    xml = re.sub(r"\s*<qemu:commandline>.*?</qemu:commandline>", "", xml, flags=re.S)
    xml = xml.replace("<rom enabled='no'/>", "")  # the NIC's ROM: efi-virtio.rom
    assert "-L" not in xml and "<rom" not in xml
    return xml


def _qemu_argv(name: str) -> list[str]:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(f"guest={name},".encode() in a for a in argv):
                return [a.decode() for a in argv if a]
    return []


def _answers(timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r = subprocess.run([*netns.exec_prefix(topology.HOSTS["client"]), "ping", "-c", "1",
                            "-W", "1", topology.GUEST_IP], capture_output=True)
        if r.returncode == 0:
            return True
    return False


def _start(name: str, emulator: Path) -> None:
    c = libvirt_lab.conn("src")
    try:
        c.defineXML(_domain_xml(name, emulator)).create()
    finally:
        c.close()


def test_installed_qemu_runs_a_domain_with_no_firmware_arguments(installed: Path,
                                                                 daemons: None) -> None:
    name = "doctor-boot"
    try:
        _start(name, installed)
        argv = _qemu_argv(name)
        assert argv and argv[0] == str(installed), argv
        assert "-L" not in argv
        assert _answers(BOOT_TIMEOUT_S), "the guest did not answer ping"
    finally:
        libvirt_lab.remove_domain(name)
        (libvirtd.shared_dir() / f"{name}.img").unlink(missing_ok=True)


@pytest.mark.long
def test_domain_on_the_installed_qemu_migrates(installed: Path, daemons: None,
                                               tmp_path: Path) -> None:
    """The destination's QEMU is started by its own daemon from the migratable XML:
    the same <emulator>, again with no -L."""
    name = "doctor-move"
    report = tmp_path / "report.json"
    try:
        _start(name, installed)
        assert _answers(BOOT_TIMEOUT_S)
        r = subprocess.run(libvirt_lab.migrate_argv(name, report, profile="livemig"),
                           capture_output=True, text=True, timeout=400)
        assert r.returncode == 0, r.stderr[-2000:]
        rep = json.loads(report.read_text())
        assert rep["outcome"] == "completed"
        assert libvirt_lab.where(name) == {"dst": "running"}
        assert _answers(10.0)
    finally:
        libvirt_lab.remove_domain(name)
        (libvirtd.shared_dir() / f"{name}.img").unlink(missing_ok=True)
