"""The per-host libvirt daemons' configuration and path mapping (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from livemig.testbed import libvirtd
from livemig.virt import conn


@pytest.fixture(autouse=True)
def _run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIVEMIG_RUN_DIR", str(tmp_path))


def test_each_daemon_listens_on_its_migration_address_with_tls_and_tcp() -> None:
    conf = libvirtd._libvirtd_conf("dst", "0f0e0d0c-0000-4000-8000-000000000002")
    assert 'listen_addr = "10.77.0.2"' in conf and "listen_tcp = 1" in conf
    assert 'auth_tcp = "none"' in conf and "listen_tls = 1" in conf
    pki = libvirtd.tls_testbed.host_dir("dst")
    assert f'cert_file = "{pki / "server-cert.pem"}"' in conf
    assert ('tls_allowed_dn_list = ["O=livemig,CN=lm-src", "O=livemig,CN=lm-dst", '
            '"O=livemig,CN=lm-dst2"]') in conf  # dst2: testbed up --hosts 2
    assert 'host_uuid = "0f0e0d0c-0000-4000-8000-000000000002"' in conf
    q = libvirtd._qemu_conf("dst")
    assert 'migration_address = "10.77.0.2"' in q and 'migration_host = "10.77.0.2"' in q
    assert 'user = "root"' in q
    assert f'migrate_tls_x509_cert_dir = "{pki}"' in q and "migrate_tls_x509_verify = 1" in q


def test_start_script_gives_the_daemon_its_own_directories() -> None:
    d = libvirtd.host_dir("src")
    script = libvirtd._start_script("src", d)
    for sub, target in (("etc", "/etc/libvirt"), ("run", "/run/libvirt"),
                        ("lib", "/var/lib/libvirt"), ("log", "/var/log/libvirt")):
        assert f"mount --bind {d / sub} {target}" in script
    assert "hostname lm-src" in script
    assert script.rstrip().endswith("exec libvirtd --listen --pid-file "
                                    "/run/libvirt/libvirtd.pid")


def test_paths_the_daemons_see_map_to_per_host_files() -> None:
    img = "/var/lib/libvirt/images/a.img"
    assert libvirtd.host_view("src", img) == libvirtd.host_dir("src") / "lib/images/a.img"
    assert libvirtd.host_view("src", img) != libvirtd.host_view("dst", img)
    shared = str(libvirtd.shared_dir() / "b.img")
    assert libvirtd.host_view("src", shared) == libvirtd.host_view("dst", shared)


def test_state_file_is_not_a_run_directory_state() -> None:
    # run directories under the run root keep a state.json; this one must not look
    # like a dead run's to the leftover reaper
    assert libvirtd.state_file().name != "state.json"


def test_uris_and_testbed_routing() -> None:
    pki = libvirtd.tls_testbed.host_dir("src")
    assert libvirtd.uri("dst") == f"qemu+tls://10.77.0.2/system?pkipath={pki}"
    assert libvirtd.tcp_uri("src") == "qemu+tcp://10.77.0.1/system"
    assert conn.testbed_side(libvirtd.uri("dst")) in ("dst", None)  # None: testbed down
    assert libvirtd.side_of_address("10.77.0.2") == "dst"
    assert libvirtd.side_of_address("192.0.2.1") is None
    assert conn.testbed_side("qemu+tcp://192.0.2.1/system") is None


def test_journal_names_only_dead_runs() -> None:
    import json

    from livemig.virt import journal

    journal.write("vm/1", src_uri="qemu+tcp://a/system", params={"x": 1})
    assert journal.left_by_dead_run("vm/1") is None  # this process is its owner
    p = journal.path("vm/1")
    data = json.loads(p.read_text())
    data["owner_pid"], data["owner_start"] = 2**22 + 7, "1"  # no such process
    p.write_text(json.dumps(data))
    left = journal.left_by_dead_run("vm/1")
    assert left is not None and left["params"] == {"x": 1}
    assert p.name != "state.json" and "/" not in p.name
    journal.remove("vm/1")
    assert journal.left_by_dead_run("vm/1") is None


def test_probed_qemu_capabilities_outlive_a_daemons_restart() -> None:
    """What a daemon probed is kept when the testbed stops it and given to the next
    daemon of any host (a fleet host keeps /var/cache/libvirt across restarts);
    a fresh daemon without it would probe each emulator inside the first migration."""
    emulator = libvirtd.root().parent / "bin" / "qemu-system-x86_64"
    emulator.parent.mkdir(parents=True)
    emulator.write_text("")
    caps = f"<qemuCaps>\n  <emulator>{emulator}</emulator>\n</qemuCaps>\n"
    old = libvirtd.host_dir("dst") / libvirtd._CAPS_SUBDIR
    old.mkdir(parents=True)
    (old / "abc.xml").write_text(caps)
    (old / "gone.xml").write_text(caps.replace(str(emulator), "/nonexistent/qemu"))
    libvirtd.save_caps(libvirtd.host_dir("dst"))
    assert (libvirtd.caps_store() / "abc.xml").read_text() == caps
    assert not (libvirtd.caps_store() / "gone.xml").exists()  # its emulator is gone
    d = libvirtd._prepare("src", "0f0e0d0c-0000-4000-8000-000000000001")
    assert (d / libvirtd._CAPS_SUBDIR / "abc.xml").read_text() == caps
    assert not libvirtd.caps_store().is_relative_to(libvirtd.root())  # down() keeps it
