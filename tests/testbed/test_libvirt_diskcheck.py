"""Copied disks of a libvirt run verified through read-only NBD exports (disk-check=nbd,
what ``auto`` picks): the held-paused destination's QEMU exports its disk node, a
reader QEMU the source daemon starts exports the source's image, and livemig compares
1 MiB SHA-256 digests of the guest-visible data, so qcow2 verifies like raw.

Real libvirt daemons on the testbed's two hosts, real QEMU (TCG). A qcow2 image is
made with the build's QEMU itself (``blockdev-create`` over QMP; this machine has no
qemu-img), the destination's copy pre-created empty (libvirt pre-creates only raw
images without qemu-img).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_libvirt_vm import (  # noqa: F401  (daemons: the fixture)
    DISK_BYTES,
    _cleanup,
    _conn,
    _define,
    _emulator,
    _migrate,
    _unique,
    _where,
    daemons,
)
from test_libvirt_vm import pytestmark as _libvirt_marks

from conftest import livemig_cmd
from livemig.testbed import libvirtd

pytestmark = list(_libvirt_marks)

NBD_METHOD = "read-only NBD exports"
QCOW2_WRITES = [(off, 0x40 + i % 32) for i, off in enumerate(range(0, DISK_BYTES, 3 << 20))]


class _Qmp:
    """QMP over a QEMU's stdio (a throwaway ``-machine none`` QEMU)."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self._line()  # greeting
        self.cmd("qmp_capabilities")

    def _line(self) -> dict[str, Any]:
        """The next QMP message (HMP qemu-io prints its own lines to stdout too)."""
        assert self.p.stdout is not None
        while True:
            line = self.p.stdout.readline()
            assert line, "QEMU exited"
            if line.startswith("{"):
                return dict(json.loads(line))

    def cmd(self, execute: str, **args: Any) -> Any:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"execute": execute, "arguments": args}) + "\n")
        self.p.stdin.flush()
        while True:
            r = self._line()
            if "error" in r:
                raise AssertionError(f"{execute}: {r['error']}")
            if "return" in r:
                return r["return"]

    def close(self) -> None:
        self.cmd("quit")
        self.p.wait(timeout=30)


def make_qcow2(path: Path, size: int, writes: list[tuple[int, int]]) -> None:
    """A qcow2 image of ``size`` bytes with 64 KiB of byte ``value`` at each offset."""
    emulator = _emulator()
    assert emulator is not None
    path.write_bytes(b"")
    q = _Qmp([str(emulator), "-machine", "none", "-nodefaults", "-display", "none",
              "-qmp", "stdio"])
    try:
        q.cmd("blockdev-add", driver="file", filename=str(path), **{"node-name": "f"})
        q.cmd("blockdev-create", **{"job-id": "c", "options": {
            "driver": "qcow2", "file": "f", "size": size}})
        # the job runs in QEMU's main loop: on a loaded host 100 polls in a row were
        # not enough for it to conclude (job-dismiss then refused a running job)
        deadline = time.monotonic() + 30
        while not all(j["status"] == "concluded" for j in q.cmd("query-jobs")):
            assert time.monotonic() < deadline, "blockdev-create did not conclude in 30 s"
            time.sleep(0.02)
        q.cmd("job-dismiss", id="c")
        q.cmd("blockdev-add", driver="qcow2", file="f", **{"node-name": "q"})
        for off, value in writes:
            q.cmd("human-monitor-command", **{
                "command-line": f'qemu-io q "write -P {value:#x} {off} 65536"'})
    finally:
        q.close()


def _define_qcow2(name: str) -> Path:
    """A running domain on src with a qcow2 disk (data written), and an empty qcow2
    of the same size where dst's copy goes; the source image as seen from here."""
    from conftest import INITRD, KERNEL
    from livemig.virt.domain import lab_domain_xml

    image = libvirtd.image_path("src", f"{name}.qcow2")
    make_qcow2(image, DISK_BYTES, QCOW2_WRITES)
    make_qcow2(libvirtd.image_path("dst", f"{name}.qcow2"), DISK_BYTES, [])
    emulator = _emulator()
    assert emulator is not None
    xml = lab_domain_xml(name, emulator, KERNEL, INITRD,
                         f"{libvirtd.IMAGES_DIR}/{name}.qcow2", memory_mib=256)
    xml = xml.replace("type='raw'", "type='qcow2'")
    c = _conn("src")
    try:
        c.defineXML(xml).create()
    finally:
        c.close()
    return image


def _leftovers() -> dict[str, Any]:
    """Reader domains on src, NBD exports on dst's QEMUs: none may be left."""
    import libvirt_qemu  # type: ignore[import-untyped]

    out: dict[str, Any] = {}
    c = _conn("src")
    try:
        out["readers"] = [d.name() for d in c.listAllDomains()
                          if d.name().startswith("livemig-diskread-")]
    finally:
        c.close()
    c = _conn("dst")
    try:
        for d in c.listAllDomains():
            if d.isActive():
                r = json.loads(libvirt_qemu.qemuMonitorCommand(
                    d, json.dumps({"execute": "query-block-exports"}), 0))
                out[d.name()] = r.get("return")
    finally:
        c.close()
    return out


def _check_ok(rep: dict[str, Any], proc: subprocess.CompletedProcess[str], name: str) -> None:
    assert proc.returncode == 0, rep.get("reason")
    assert rep["outcome"] == "completed"
    disk = rep["consistency"]["disk_detail"]
    assert rep["consistency"]["disk"] == "ok", disk
    assert disk["method"].startswith(NBD_METHOD), disk
    vda = disk["disks"]["vda"]
    assert vda["result"] == "ok" and vda["bytes"] == DISK_BYTES, vda
    assert vda["chunk_size"] == 1 << 20
    assert vda["source_s"] > 0 and vda["destination_s"] > 0
    assert vda["cost_s_per_gib"]["destination"] > 0
    assert disk["hold_s"] >= vda["wall_s"]
    assert any(e["event"] == "disk exports" for e in rep["events"])
    assert any(e["event"] == "destination resumed" for e in rep["events"])
    assert _where(name) == {"src": None, "dst": "running"}
    left = _leftovers()
    assert left["readers"] == [] and left.get(name) == [], left


@pytest.mark.usefixtures("daemons")
def test_copied_raw_disk_verified_through_nbd_exports(tmp_path: Path) -> None:
    name = _unique("lmnbd")
    _define(name, "copy")
    try:
        proc, rep = _migrate(tmp_path, name, "--storage", "copy", "--max-time", "180")
        _check_ok(rep, proc, name)
        assert rep["settings"]["libvirt_plan"]["disk_check"] == "auto"
        assert "disk ok (vda:" in proc.stdout
    finally:
        _cleanup(name)


@pytest.mark.long
@pytest.mark.usefixtures("daemons")
def test_copied_qcow2_disk_verified_through_nbd_exports(tmp_path: Path) -> None:
    """Guest-visible data: the two qcow2 files differ as files (the destination's
    clusters are laid out by the mirror's write order), their contents do not."""
    name = _unique("lmnbdq")
    _define_qcow2(name)
    try:
        proc, rep = _migrate(tmp_path, name, "--storage", "copy", "--set",
                             "disk-check=nbd", "--max-time", "180")
        _check_ok(rep, proc, name)
    finally:
        _cleanup(name)


@pytest.mark.usefixtures("daemons")
def test_corrupted_destination_qcow2_block_is_named(tmp_path: Path) -> None:
    """A guest-visible byte of the destination's qcow2 disk flipped through its QEMU
    (HMP qemu-io) after the copy, before the comparison: a mismatch naming the 1 MiB
    block and the byte, exit 4, the destination never runs (held paused), and the
    source's image is untouched; no export or reader QEMU is left behind."""
    offset = 0x304567  # inside the 64 KiB written at 3 MiB
    name = _unique("lmnbdbad")
    src_image = _define_qcow2(name)
    before = src_image.read_bytes()
    try:
        report = tmp_path / "report.json"
        proc = subprocess.run(livemig_cmd(
            "migrate", "--domain", name, "--connect", libvirtd.uri("src"),
            "--to", libvirtd.uri("dst"), "--storage", "copy", "--report", str(report),
            "--inject-fault", f"disk-byte@{offset:#x}", "--max-time", "180"),
            capture_output=True, text=True, timeout=240,
            env={**os.environ, "LIVEMIG_ALLOW_FAULT_INJECTION": "1"})
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr[-3000:])
        rep = json.loads(report.read_text())
        assert proc.returncode == 4, proc.stderr[-2000:]
        assert rep["outcome"] == "completed"
        assert rep["consistency"]["disk"] == "mismatch", rep["consistency"]
        vda = rep["consistency"]["disk_detail"]["disks"]["vda"]
        chunk = offset & ~((1 << 20) - 1)
        assert vda["method"].startswith(NBD_METHOD)
        assert vda["mismatched_chunks"] == 1
        assert vda["first_mismatched_chunks"] == [f"{chunk:#x}"]
        assert vda["first_differing_chunk"]["range"] == [f"{chunk:#x}",
                                                         f"{chunk + (1 << 20):#x}"]
        assert vda["first_differing_byte"] == f"{offset:#x}"
        assert f"at byte {offset:#x}" in proc.stdout
        assert not any(e["event"] == "destination resumed" for e in rep["events"])
        assert _where(name)["src"] is None and _where(name)["dst"] not in (None, "running")
        assert src_image.read_bytes() == before  # the source's copy is untouched
        left = _leftovers()
        assert left["readers"] == [] and left.get(name) == [], left
    finally:
        _cleanup(name)
