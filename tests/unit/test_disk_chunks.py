"""The copied disks' chunk digests and drill-down (pure, no VM, no libvirt)."""

from __future__ import annotations

import hashlib
import random

import pytest

from livemig.errors import UsageError
from livemig.virt.chunks import (
    HASH,
    ChunkHasher,
    chunk_range,
    diff_chunks,
    digests_of,
    first_differing_byte,
)
from livemig.virt.facts import disk_formats
from livemig.virt.plan import disk_check_fallback, disk_check_method

K = 1024


def _image(size: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    data = bytearray(size)
    for off in range(0, size, 3 * K):  # data islands between zero runs
        data[off:off + K] = rng.randbytes(min(K, size - off))
    return bytes(data)


def test_digest_per_chunk_is_the_hash_of_the_chunk() -> None:
    data = _image(10 * K)
    d = digests_of(data, 4 * K)
    assert d.size == 10 * K and d.chunk == 4 * K and len(d.digests) == 3
    for i, dig in enumerate(d.digests):
        assert dig == hashlib.new(HASH, data[i * 4 * K:(i + 1) * 4 * K]).digest()


def test_pieces_and_holes_digest_like_the_whole() -> None:
    """However the stream cuts the image (data pieces of any size, holes instead of
    zeros, across chunk borders), the digests are those of the bytes."""
    data = bytearray(_image(37 * K, seed=2))
    data[5 * K:23 * K] = bytes(18 * K)  # a hole spanning whole chunks
    whole = digests_of(bytes(data), 4 * K)
    h = ChunkHasher(4 * K)
    rng = random.Random(3)
    off = 0
    while off < len(data):
        n = min(rng.randint(1, 9 * K), len(data) - off)
        piece = bytes(data[off:off + n])
        if not any(piece):
            h.hole(n)
        else:
            h.data(piece)
        off += n
    assert h.finish() == whole
    h2 = ChunkHasher(4 * K)
    h2.data(bytes(data[:5 * K]))
    h2.hole(18 * K)
    h2.data(bytes(data[23 * K:]))
    assert h2.finish() == whole


def test_equal_images_are_equal() -> None:
    data = _image(64 * K)
    diff = diff_chunks(digests_of(data, 8 * K), digests_of(data, 8 * K))
    assert diff.equal and diff.first is None and diff.chunks == 8


def test_a_flipped_byte_names_its_chunk_and_byte() -> None:
    a = _image(64 * K)
    off = 29 * K + 123
    b = bytearray(a)
    b[off] ^= 0xFF
    diff = diff_chunks(digests_of(a, 8 * K), digests_of(bytes(b), 8 * K))
    assert not diff.equal and diff.differing == (3,) and diff.first == 3
    start, end = chunk_range(3, 8 * K, len(a))
    assert (start, end) == (24 * K, 32 * K)
    assert first_differing_byte(a[start:end], bytes(b[start:end])) == off - start


def test_several_differing_chunks_in_order() -> None:
    a = _image(64 * K)
    b = bytearray(a)
    for off in (60 * K, 1, 17 * K):
        b[off] ^= 1
    diff = diff_chunks(digests_of(a, 8 * K), digests_of(bytes(b), 8 * K))
    assert diff.differing == (0, 2, 7)


def test_sizes_that_differ_are_a_difference() -> None:
    a = _image(20 * K)
    b = a + bytes(K)  # one more KiB of zeros: still not the same disk
    diff = diff_chunks(digests_of(a, 8 * K), digests_of(b, 8 * K))
    assert not diff.equal and diff.sizes == (20 * K, 21 * K)
    assert diff.differing == (2,)  # the short last chunk
    assert first_differing_byte(a[16 * K:], b[16 * K:]) == 4 * K
    c = a + bytes(12 * K)  # a whole chunk more
    assert diff_chunks(digests_of(a, 8 * K), digests_of(c, 8 * K)).differing == (2, 3)


def test_chunk_range_at_the_end() -> None:
    assert chunk_range(2, 8 * K, 20 * K) == (16 * K, 20 * K)
    assert chunk_range(3, 8 * K, 20 * K) == (24 * K, 24 * K)


def test_first_differing_byte() -> None:
    assert first_differing_byte(b"abc", b"abc") is None
    assert first_differing_byte(b"", b"") is None
    assert first_differing_byte(b"abc", b"abd") == 2
    assert first_differing_byte(b"abc", b"abcd") == 3
    big = bytes(10000)
    assert first_differing_byte(big, big[:9000] + b"\1" + big[9001:]) == 9000


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        ChunkHasher(0)
    with pytest.raises(ValueError):
        ChunkHasher(8).hole(-1)
    with pytest.raises(ValueError):
        diff_chunks(digests_of(b"x", 8), digests_of(b"x", 16))


def test_disk_check_method() -> None:
    assert disk_check_method("auto", True) == "nbd"
    assert disk_check_method("auto", False) == "nbd"
    assert disk_check_method("nbd", False) == "nbd"
    assert disk_check_fallback(True) == "file"
    assert disk_check_fallback(False) == "stream"
    assert disk_check_method("stream", True) == "stream"
    assert disk_check_method("file", True) == "file"
    with pytest.raises(UsageError, match="disk-check=file needs"):
        disk_check_method("file", False)


def test_disk_formats() -> None:
    xml = ("<domain><devices>"
           "<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>"
           "<source file='/a.qcow2'/><target dev='vda'/></disk>"
           "<disk type='file' device='disk'><source file='/b.img'/><target dev='vdb'/>"
           "</disk></devices></domain>")
    assert disk_formats(xml) == {"vda": "qcow2", "vdb": "raw"}
