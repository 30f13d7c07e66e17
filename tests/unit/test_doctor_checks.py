"""``livemig doctor``'s checks on synthetic facts (no libvirt, no QEMU): every finding
the gathered facts can lead to, including the ones that must fail the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from livemig.doctor import checks, gather
from livemig.doctor.checks import FAIL, OK, WARN, can_take_part, check
from livemig.doctor.facts import HostFacts, QemuFacts
from livemig.doctor.probe import parse

PATCHED = QemuFacts(
    "/opt/livemig/qemu/bin/qemu-system-x86_64", version="10.2.2",
    commands=frozenset({"set-cpu-throttle", "x-query-ram-digest", "x-calc-ram-sample"}),
    capabilities=frozenset({"x-ram-digest-check", "x-switchover-drain",
                            "x-multifd-compression-switch", "multifd"}),
    parameters=frozenset({"multifd-lz4-acceleration", "x-hot-page-defer-percent",
                          "x-multifd-lz4-delta-cache-size", "max-bandwidth"}))
STOCK = QemuFacts("/usr/bin/qemu-system-x86_64", version="10.2.2",
                  commands=frozenset({"migrate"}), capabilities=frozenset({"multifd"}),
                  parameters=frozenset({"max-bandwidth"}))
GOOD = HostFacts(
    uri="qemu+tls://10.77.0.2/system", hostname="lm-dst", libvirt_version=9_000_000,
    hypervisor_version=10_002_002, emulator=PATCHED.path, emulator_given=True,
    libvirt_kvm=True, local=True, kvm_problem=None, qemu=PATCHED, tls_dir="/etc/pki/qemu",
    tls_missing=(), free_memory=20 << 30, total_memory=24 << 30, running=2)


def levels(f: HostFacts) -> dict[str, str]:
    return {x.what: x.level for x in check(f)}


def test_a_good_host_is_all_ok() -> None:
    found = check(GOOD)
    assert [x.level for x in found] == [OK] * len(found), [x.line() for x in found]
    assert [x.what for x in found] == ["libvirt", "emulator", "qemu", "mechanisms",
                                       "firmware", "tls", "kvm", "memory", "domains"]
    assert can_take_part(found)
    mech = next(x for x in found if x.what == "mechanisms")
    assert all(m in mech.detail for m, _, _ in checks.MECHANISMS)
    assert found[0].line().startswith("ok    libvirt    9.0.0 on lm-dst")


@pytest.mark.parametrize("facts, what", [
    (replace(GOOD, emulator=None, domcaps_error="no emulator for arch x86_64"), "emulator"),
    (replace(GOOD, domcaps_error="Cannot find QEMU binary"), "emulator"),
    (replace(GOOD, qemu=QemuFacts("/bin/true", error="not a QEMU")), "qemu"),
    (replace(GOOD, qemu=replace(PATCHED, gnutls=False)), "qemu"),
    (replace(GOOD, tls_missing=("server-key.pem",)), "tls"),
    (replace(GOOD, free_memory=100 << 20), "memory"),
])
def test_what_fails_a_host(facts: HostFacts, what: str) -> None:
    found = check(facts)
    assert not can_take_part(found)
    assert FAIL in [x.level for x in found if x.what == what], [x.line() for x in found]


@pytest.mark.parametrize("facts, what", [
    (replace(GOOD, qemu=STOCK), "mechanisms"),
    (replace(GOOD, qemu=replace(PATCHED, commands=frozenset())), "mechanisms"),
    (replace(GOOD, qemu=replace(PATCHED, firmware_error="could not load PC BIOS")),
     "firmware"),
    (replace(GOOD, kvm_problem="no vmx/svm in /proc/cpuinfo"), "kvm"),
    (replace(GOOD, local=False, kvm_problem=None, libvirt_kvm=False), "kvm"),
    (replace(GOOD, free_memory=1 << 30), "memory"),
    (replace(GOOD, libvirt_version=8_000_000), "libvirt"),
    (replace(GOOD, qemu=replace(PATCHED, version="8.2.0")), "qemu"),
])
def test_what_only_warns(facts: HostFacts, what: str) -> None:
    found = check(facts)
    assert can_take_part(found)
    assert levels(facts)[what] == WARN, [x.line() for x in found]


def test_partial_build_names_what_it_lacks() -> None:
    q = replace(PATCHED, capabilities=frozenset({"x-ram-digest-check"}))
    mech = next(x for x in check(replace(GOOD, qemu=q)) if x.what == "mechanisms")
    assert "lacks switchover drain" in mech.detail


def test_remote_host_is_checked_through_libvirt_only() -> None:
    f = replace(GOOD, local=False, qemu=None, tls_dir=None, tls_missing=None,
                kvm_problem=None)
    lv = levels(f)
    assert lv["qemu"] == OK  # libvirt's hypervisor version
    assert lv["mechanisms"] == WARN and lv["tls"] == WARN and lv["kvm"] == OK
    assert "firmware" not in lv
    assert can_take_part(check(f))


def test_tls_off_is_not_required() -> None:
    f = replace(GOOD, tls_required=False, tls_missing=("ca-cert.pem",),
                qemu=replace(PATCHED, gnutls=False))
    assert levels(f)["tls"] == OK and can_take_part(check(f))


def test_versions() -> None:
    assert checks.version_text(9_000_000) == "9.0.0"
    assert checks.version_text(10_002_002) == "10.2.2"
    assert checks.version_tuple("10.2.2") > checks.version_tuple("10.1.90")


def _qmp(*answers: dict[str, object]) -> str:
    return "\n".join(json.dumps(a) for a in answers)


def test_probe_parses_a_qemus_answers() -> None:
    out = _qmp({"QMP": {}}, {"return": {}},
               {"id": "version", "return": {"qemu": {"major": 10, "minor": 2, "micro": 2}}},
               {"id": "commands", "return": [{"name": "set-cpu-throttle"}]},
               {"id": "caps", "return": [{"capability": "x-switchover-drain", "state": False}]},
               {"id": "params", "return": {"multifd-lz4-acceleration": 1}},
               {"id": "tls", "error": {"desc": "TLS credentials support requires GNUTLS"}})
    q = parse("/q", out, "")
    assert q.error is None and q.version == "10.2.2" and not q.gnutls
    assert "set-cpu-throttle" in q.commands and "x-switchover-drain" in q.capabilities
    bad = parse("/bin/true", "", "")
    assert bad.error and "not a QEMU" in bad.error


def test_qemu_conf_tls_dir(tmp_path: Path) -> None:
    conf = tmp_path / "qemu.conf"
    assert gather.tls_dir(conf) == gather.DEFAULT_TLS_DIR  # no file: libvirt's default
    conf.write_text('# x\ndefault_tls_x509_cert_dir = "/etc/pki/d"\n')
    assert gather.tls_dir(conf) == "/etc/pki/d"
    conf.write_text('default_tls_x509_cert_dir = "/etc/pki/d"\n'
                    '  migrate_tls_x509_cert_dir = "/etc/pki/m"\n'
                    '#migrate_tls_x509_cert_dir = "/nope"\n')
    assert gather.tls_dir(conf) == "/etc/pki/m"


def test_which_hosts_are_local() -> None:
    assert gather.local_config("qemu:///system") == Path(gather.QEMU_CONF)
    assert gather.local_config("qemu+tls://far.example/system") is None


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "livemig.cli", "doctor", *args],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("args, code", [
    (["not-a-uri"], 2),
    (["qemu:///system", "--emulator", "/nonexistent/qemu"], 2),
    (["qemu+tcp://127.0.0.9:1/system"], 1),  # nothing listens: libvirt's one line
])
def test_cli_bad_input_is_one_line(args: list[str], code: int) -> None:
    r = _cli(*args)
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("livemig: error:"), r.stderr


def test_confinement_findings() -> None:
    assert "apparmor" not in levels(GOOD)  # unknown (a remote host): no line
    assert levels(replace(GOOD, confined=False))["apparmor"] == OK
    assert levels(replace(GOOD, confined=True, confinement_allows=True))["apparmor"] == OK
    denied = replace(GOOD, confined=True, confinement_allows=False)
    assert levels(denied)["apparmor"] == FAIL and not can_take_part(check(denied))


def test_confinement_reads_the_profiles(tmp_path: Path) -> None:
    from livemig.install import apparmor

    conf = tmp_path / "qemu.conf"
    emu = "/opt/livemig/qemu/bin/qemu-system-x86_64"
    root = tmp_path / "root"
    assert gather.confinement(conf, emu, root) == (False, None)  # no libvirt profiles
    (root / apparmor.ABSTRACTION).parent.mkdir(parents=True)
    (root / apparmor.ABSTRACTION).write_text("  /usr/bin/qemu-system-x86_64 rmix,\n")
    assert gather.confinement(conf, emu, root) == (True, False)
    assert gather.confinement(conf, "/usr/bin/qemu-system-x86_64", root) == (True, True)
    apparmor.write(apparmor.Rules(Path("/opt/livemig/qemu"), Path(emu)), root)
    assert gather.confinement(conf, emu, root) == (True, True)
    conf.write_text('security_driver = "none"\n')
    assert gather.confinement(conf, emu, root) == (False, None)


def test_gate_returns_only_what_keeps_a_host_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from livemig.doctor import gate

    monkeypatch.setattr(gate, "gather", lambda _u, _e, _t: replace(GOOD, free_memory=1 << 20))
    v = gate.examine("qemu:///system")
    assert [(f.level, f.what) for f in v.fails] == [(FAIL, "memory")] and v.stock is None
    monkeypatch.setattr(gate, "gather", lambda _u, _e, _t: replace(GOOD, qemu=STOCK))
    v = gate.examine("qemu:///system")
    assert v.fails == [] and v.stock  # a stock QEMU only warns, and is named as one


def test_the_remote_probe_domain_has_no_disk_nor_network_and_its_answers_are_read() -> None:
    import xml.etree.ElementTree as ET

    from livemig.doctor.remote import _facts, domain_xml
    from livemig.qemucaps import TLS_PROBE
    from livemig.virt.conn import LibvirtError

    root = ET.fromstring(domain_xml("p<1>", "/opt/q&q/qemu"))
    assert root.findtext("name") == "p<1>" and root.findtext("devices/emulator") == "/opt/q&q/qemu"
    assert root.find("devices/disk") is None and root.find("devices/interface") is None
    answers = {"query-version": {"qemu": {"major": 10, "minor": 2, "micro": 2}},
               "query-commands": [{"name": "x-calc-ram-sample"}, {"name": "migrate"}],
               "query-migrate-capabilities": [{"capability": "x-switchover-drain",
                                               "state": False}],
               "query-migrate-parameters": {"max-bandwidth": 1}}
    asked: list[str] = []

    def ask(execute: str, **kw: object) -> object:
        asked.append(execute)
        if execute == "object-add":
            assert kw == TLS_PROBE
            raise LibvirtError("object-add: TLS credentials support requires GNUTLS")
        return answers[execute]

    q = _facts("/q", ask)
    assert q.version == "10.2.2" and "x-calc-ram-sample" in q.commands
    assert q.capabilities == {"x-switchover-drain"} and q.parameters == {"max-bandwidth"}
    assert q.gnutls is False and "object-del" not in asked
