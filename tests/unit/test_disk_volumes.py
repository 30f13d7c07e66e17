"""The streamed comparison of copied disks (virt.volumes) against fake libvirt
connections: the stream, the drill-down, the fault and the skips (no daemon)."""

from __future__ import annotations

import os
from typing import Any

import pytest

libvirt = pytest.importorskip("libvirt")

from livemig.virt import volumes  # noqa: E402
from livemig.virt.facts import DiskEnds, compare_copied_disks  # noqa: E402

MIB = 1 << 20
PIECE = 256 << 10
PATH = "/var/lib/libvirt/images/vm.img"


class FakeStream:
    def __init__(self) -> None:
        self.data = b""
        self.target: tuple[bytearray, int] | None = None

    def sparseRecvAll(self, handler: Any, hole: Any, opaque: Any) -> None:
        for off in range(0, len(self.data), PIECE):
            piece = self.data[off:off + PIECE]
            if any(piece):
                handler(self, piece, opaque)
            else:
                hole(self, len(piece), opaque)

    def recvAll(self, handler: Any, opaque: Any) -> None:
        for off in range(0, len(self.data), PIECE):
            handler(self, self.data[off:off + PIECE], opaque)

    def send(self, data: bytes) -> int:
        assert self.target is not None
        image, off = self.target
        image[off:off + len(data)] = data
        return len(data)

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


class FakeVol:
    def __init__(self, image: bytearray) -> None:
        self.image = image
        self.downloads: list[tuple[int, int]] = []

    def download(self, stream: FakeStream, offset: int, length: int, flags: int) -> int:
        self.downloads.append((offset, length))
        end = len(self.image) if length == 0 else offset + length
        stream.data = bytes(self.image[offset:end])
        return 0

    def upload(self, stream: FakeStream, offset: int, length: int, flags: int) -> int:
        stream.target = (self.image, offset)
        return 0

    def info(self) -> list[int]:
        return [0, len(self.image), len(self.image)]


class FakePool:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.refreshed = 0

    def XMLDesc(self, flags: int) -> str:
        return f"<pool type='dir'><target><path>{self.directory}</path></target></pool>"

    def refresh(self, flags: int) -> int:
        self.refreshed += 1
        return 0


class FakeConn:
    def __init__(self, image: bytearray, pool: str | None = os.path.dirname(PATH)) -> None:
        self.vol = FakeVol(image)
        self.pools = [FakePool(pool)] if pool else []

    def listAllStoragePools(self, flags: int) -> list[FakePool]:
        return self.pools

    def storageVolLookupByPath(self, path: str) -> FakeVol:
        if path != PATH or not self.pools or not self.pools[0].refreshed:
            raise libvirt.libvirtError("Storage volume not found")
        return self.vol

    def newStream(self, flags: int) -> FakeStream:
        return FakeStream()

    def getHostname(self) -> str:
        return "lm-x"


def _image(size: int = 5 * MIB + 4096) -> bytearray:
    img = bytearray(size)
    for off in range(0, size, MIB):
        img[off:off + 64] = os.urandom(64)
    return img


def _compare(a: bytearray, b: bytearray, fault: int | None = None,
             formats: dict[str, str] | None = None,
             dst_pool: str | None = os.path.dirname(PATH)) -> dict[str, Any]:
    events: list[tuple[str, dict[str, Any]]] = []
    ends = DiskEnds("qemu+tcp://a/system", "qemu+tcp://b/system", FakeConn(a),
                    FakeConn(b, dst_pool))
    return compare_copied_disks(ends, {"vda": PATH}, formats or {"vda": "raw"}, "stream",
                                fault, lambda what, **kw: events.append((what, kw)))


def test_equal_images_are_ok_with_their_cost() -> None:
    img = _image()
    res = _compare(img, bytearray(img))
    assert res["result"] == "ok" and res["method"] == volumes.METHOD
    vda = res["disks"]["vda"]
    assert vda["bytes"] == len(img) and vda["chunk_size"] == MIB
    assert set(vda["cost_s_per_gib"]) == {"source", "destination"}
    assert vda["destination"] == f"qemu+tcp://b/system {PATH}"


def test_a_differing_byte_is_named_by_chunk_and_offset() -> None:
    a = _image()
    b = bytearray(a)
    off = 3 * MIB + 12345
    b[off] ^= 0x10
    b[5 * MIB + 7] ^= 1  # the short last chunk differs too
    res = _compare(a, b)
    vda = res["disks"]["vda"]
    assert res["result"] == "mismatch"
    assert vda["mismatched_chunks"] == 2
    assert vda["first_mismatched_chunks"] == [f"{3 * MIB:#x}", f"{5 * MIB:#x}"]
    assert vda["first_differing_chunk"] == {"index": 3, "range": [f"{3 * MIB:#x}",
                                                                  f"{4 * MIB:#x}"]}
    assert vda["first_differing_byte"] == f"{off:#x}"


def test_the_fault_flips_one_byte_of_the_destination_through_libvirt() -> None:
    a = _image()
    b = bytearray(a)
    res = _compare(a, b, fault=0x234567)
    off = 0x234567
    assert b[off] == a[off] ^ 0xFF and b[:off] == a[:off] and b[off + 1:] == a[off + 1:]
    assert res["disks"]["vda"]["first_differing_byte"] == "0x234567"


def test_different_sizes_differ_where_the_shorter_ends() -> None:
    a = _image(3 * MIB)
    b = bytearray(a) + bytearray(MIB)
    vda = _compare(a, b)["disks"]["vda"]
    assert vda["result"] == "mismatch"
    assert vda["sizes"] == {"source": 3 * MIB, "destination": 4 * MIB}
    assert vda["first_differing_byte"] == f"{3 * MIB:#x}"


def test_a_disk_in_no_pool_is_skipped_with_what_to_define() -> None:
    img = _image()
    res = _compare(img, bytearray(img), dst_pool=None)
    assert res["result"] == "skipped"
    why = res["disks"]["vda"]["why"]
    assert "no storage pool on lm-x" in why and "define a dir pool over " \
        "/var/lib/libvirt/images" in why
    assert "\n" not in why and res["why"].startswith("vda: ")


def test_qcow2_is_skipped_without_reading() -> None:
    img = _image()
    res = _compare(img, bytearray(img), formats={"vda": "qcow2"})
    assert res["result"] == "skipped" and "qcow2" in res["disks"]["vda"]["why"]


def test_fault_beyond_the_image_is_one_line() -> None:
    img = _image(MIB)
    with pytest.raises(Exception, match="beyond the destination's image"):
        _compare(img, bytearray(img), fault=2 * MIB)


def test_the_summary_line_says_where_and_why() -> None:
    from livemig.report import _disk_note as report_note

    def _disk_note(d: dict[str, object]) -> str:
        return report_note(str(d["result"]), d)

    a = _image()
    b = bytearray(a)
    b[MIB + 5] ^= 1
    note = _disk_note(_compare(a, b))
    assert note == f" (vda: 1 chunk(s) differ, first [{MIB:#x}, {2 * MIB:#x}) at byte " \
        f"{MIB + 5:#x})"
    assert "define a dir pool" in _disk_note(_compare(a, bytearray(a), dst_pool=None))
    assert _disk_note(_compare(a, bytearray(a))).startswith(" (vda: 5.0 MiB, source ")
