"""``livemig install-qemu`` without QEMU: a fake build, fake firmware directories and
a fake /etc, so what is linked, kept, rewritten and removed can be checked exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from livemig.errors import SetupError, UsageError
from livemig.install import apparmor, firmware, qemu


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with a built (fake) QEMU, and Debian's three firmware directories."""
    build = tmp_path / "checkout" / "build" / "qemu"
    build.mkdir(parents=True)
    (build / qemu.BINARY).write_text("#!/bin/sh\necho v1\n")
    (build / "stamp").write_text("key=abc\n")
    monkeypatch.setenv("LIVEMIG_ROOT", str(tmp_path / "checkout"))
    share, sea, ipxe = (tmp_path / d for d in ("usr-share-qemu", "seabios", "ipxe"))
    for d in (share, sea, ipxe, share / "keymaps"):
        d.mkdir()
    (share / "kvmvapic.bin").write_text("q")
    (share / "bios-microvm.bin").write_text("from qemu")
    (sea / "bios-256k.bin").write_text("s")
    (sea / "bios-microvm.bin").write_text("from seabios")
    (ipxe / "efi-virtio.rom").write_text("i")
    monkeypatch.setattr(firmware, "SOURCES", (share, sea, ipxe))
    return tmp_path


def test_links_first_directory_wins(fake: Path) -> None:
    plan = firmware.links(firmware.SOURCES)
    assert plan["bios-microvm.bin"] == fake / "usr-share-qemu" / "bios-microvm.bin"
    assert plan["bios-256k.bin"] == fake / "seabios" / "bios-256k.bin"
    assert plan["efi-virtio.rom"] == fake / "ipxe" / "efi-virtio.rom"
    assert plan["keymaps"] == fake / "usr-share-qemu" / "keymaps"


def test_install_is_idempotent_and_uninstall_removes_only_ours(fake: Path) -> None:
    prefix = fake / "opt" / "q"
    r = qemu.install(prefix, root=fake / "root")
    binary = prefix / "bin" / qemu.BINARY
    assert r.copied and binary.read_text().endswith("v1\n")
    assert os.stat(binary).st_mode & 0o777 == 0o755
    data = prefix / "share" / "qemu"
    assert os.readlink(data / "bios-256k.bin") == str(fake / "seabios" / "bios-256k.bin")
    assert r.links == 5 and r.changed_links == 5
    again = qemu.install(prefix, root=fake / "root")
    assert not again.copied and again.changed_links == 0
    (data / "mine.bin").write_text("not livemig's")  # someone else's file stays
    removed = qemu.uninstall(prefix, root=fake / "root")
    assert binary in removed and not binary.exists()
    assert sorted(p.name for p in data.iterdir()) == ["mine.bin"]


def test_rebuilt_binary_is_replaced_and_stale_links_go(fake: Path) -> None:
    prefix = fake / "p"
    qemu.install(prefix, root=fake / "root")
    (fake / "checkout/build/qemu" / qemu.BINARY).write_text("#!/bin/sh\necho v2\n")
    (fake / "ipxe" / "efi-virtio.rom").unlink()
    r = qemu.install(prefix, root=fake / "root")
    assert r.copied and (prefix / "bin" / qemu.BINARY).read_text().endswith("v2\n")
    assert not (prefix / "share/qemu/efi-virtio.rom").is_symlink()
    assert "efi-virtio.rom" not in json.loads((prefix / qemu.MANIFEST).read_text())["links"]


def test_foreign_files_are_never_overwritten(fake: Path) -> None:
    prefix = fake / "usr"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / qemu.BINARY).write_text("the distribution's QEMU")
    with pytest.raises(SetupError, match="not installed by livemig"):
        qemu.install(prefix, root=fake / "root")
    assert (prefix / "bin" / qemu.BINARY).read_text() == "the distribution's QEMU"
    other = fake / "other"
    (other / "share/qemu").mkdir(parents=True)
    (other / "share/qemu/bios-256k.bin").write_text("a real file")
    r = qemu.install(other, root=fake / "root")
    assert r.kept == ["bios-256k.bin"]
    assert (other / "share/qemu/bios-256k.bin").read_text() == "a real file"
    qemu.uninstall(other, root=fake / "root")
    assert (other / "share/qemu/bios-256k.bin").read_text() == "a real file"


def test_refusals(fake: Path) -> None:
    with pytest.raises(SetupError, match="make qemu-upstream"):
        qemu.install(fake / "p", upstream=True, root=fake / "root")
    with pytest.raises(UsageError, match="absolute"):
        qemu.install(Path("relative/p"), root=fake / "root")
    with pytest.raises(UsageError, match="quotes"):
        qemu.install(fake / 'a"b', root=fake / "root")
    with pytest.raises(UsageError, match="nothing of livemig's"):
        qemu.uninstall(fake / "never", root=fake / "root")
    (fake / "seabios" / "bios-256k.bin").unlink()
    with pytest.raises(SetupError, match="seabios"):
        qemu.install(fake / "p", root=fake / "root")


def test_root_owned_prefix_needs_root(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda _p, _m: False)  # as a user other than root
    with pytest.raises(SetupError, match="owned by root\\): run as root"):
        qemu.install(Path("/opt/livemig-test-not-writable/q"))


def test_apparmor_rules_written_and_removed(fake: Path) -> None:
    root = fake / "root"
    (root / apparmor.ABSTRACTION).parent.mkdir(parents=True)
    (root / apparmor.ABSTRACTION).write_text("# libvirt's\n")
    local = root / apparmor.DAEMON_LOCAL
    local.parent.mkdir(parents=True)
    local.write_text("# the admin's own rule\n/srv/x r,\n")
    prefix = fake / "opt" / "lq"
    r = qemu.install(prefix, root=root)
    assert len(r.apparmor) == 2
    dropin = root / apparmor.DOMAIN_DROPIN_DIR / apparmor.Rules(prefix, r.binary).name
    assert f'"{r.binary}" rmix,' in dropin.read_text()
    assert local.read_text().count(f'"{r.binary}" PUx,') == 1
    qemu.install(prefix, root=root)  # again: still one block
    assert local.read_text().count(f'"{r.binary}" PUx,') == 1
    qemu.uninstall(prefix, root=root)
    assert not dropin.exists()
    assert local.read_text() == "# the admin's own rule\n/srv/x r,\n"


def test_no_apparmor_where_libvirt_has_no_profiles(fake: Path) -> None:
    r = qemu.install(fake / "p", root=fake / "root")
    assert r.apparmor == [] and not (fake / "root").exists()


def test_cli_refuses_in_one_line(fake: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "livemig.cli", "install-qemu", "--upstream",
                        "--prefix", str(fake / "p")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "make qemu-upstream" in r.stderr


def test_uninstall_refused_while_a_qemu_runs_from_it(fake: Path) -> None:
    prefix = fake / "p"
    qemu.install(prefix, root=fake / "root")
    binary = prefix / "bin" / qemu.BINARY
    # a stand-in QEMU: a real executable (a script's exe would be its interpreter)
    binary.write_bytes(Path("/bin/sleep").read_bytes())
    sleeper = subprocess.Popen([str(binary), "30"])
    try:
        assert qemu.running_from(binary) == [sleeper.pid]
        with pytest.raises(UsageError, match="migrate or stop those domains"):
            qemu.uninstall(prefix, root=fake / "root")
        assert binary.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    qemu.uninstall(prefix, root=fake / "root")
    assert not binary.exists()
