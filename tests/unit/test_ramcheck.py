import os

from livemig.lab.faults import flip_byte
from livemig.ramcheck import compare_ram, gpa_to_offset, offset_to_gpa


def _pair(tmp_path, size):
    data = os.urandom(size)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data)
    return a, b


def test_identical(tmp_path):
    a, b = _pair(tmp_path, 8 << 20)
    res = compare_ram(a, b, 8 << 20)
    assert res.ok and res.pages == 2048


def test_one_flipped_byte_is_named(tmp_path):
    a, b = _pair(tmp_path, 8 << 20)
    flip_byte(b, gpa_to_offset(0x5A3123, 8 << 20))
    res = compare_ram(a, b, 8 << 20)
    assert not res.ok and res.mismatched_pages == 1
    assert res.first_mismatches == [0x5A3000]
    assert res.as_dict()["first_mismatches"] == ["0x5a3000"]


def test_q35_high_memory_mapping():
    ram = 4 << 30  # >= 2.75G: 2G below 4G, the rest above
    assert offset_to_gpa(0x1000, ram) == 0x1000
    assert offset_to_gpa(0x80000000, ram) == 1 << 32
    assert gpa_to_offset(1 << 32, ram) == 0x80000000
    assert offset_to_gpa(0x1000, 1 << 30) == 0x1000


def _sparse(path, size, writes):
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in writes:
            f.seek(off)
            f.write(data)


def test_sparse_files_are_compared_without_filling_their_holes(tmp_path):
    """A hole in one file and zeros or data in the other: the data is still compared;
    the holes stay holes (tmpfs would allocate pages on a mapped read)."""
    size = 64 << 20
    a, b = tmp_path / "a", tmp_path / "b"
    blob = os.urandom(8192)
    _sparse(a, size, [(20 << 20, blob), (40 << 20, b"\0" * 4096)])
    _sparse(b, size, [(20 << 20, blob)])
    res = compare_ram(a, b, size)
    assert res.ok and res.pages == size // 4096
    _sparse(b, size, [(20 << 20, blob), (50 << 20, b"x")])  # data only in dst
    res = compare_ram(a, b, size)
    assert not res.ok and res.first_mismatches == [50 << 20]
    _sparse(a, size, [(20 << 20, blob), (60 << 20, b"y")])  # data only in src
    res = compare_ram(a, b, size)
    assert res.mismatched_pages == 2
    assert os.stat(a).st_blocks * 512 < 1 << 20  # still sparse
