"""Pure logic of the disk comparison, fault placement, probes and mirror accounting."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from livemig.errors import LivemigError
from livemig.lab import faults
from livemig.lab.diskcheck import compare_images
from livemig.lab.storage import MirrorStats
from livemig.testbed.probe import ProbeStats
from livemig.testbed.topology import LinkShape


def _image(path, size=1 << 20, fill=b"\x5a"):
    path.write_bytes(fill * size)
    return path


def test_identical_images_compare_ok(tmp_path):
    a, b = _image(tmp_path / "a"), _image(tmp_path / "b")
    res = compare_images(a, b)
    assert res.ok and res.blocks == 256 and res.as_dict()["result"] == "ok"


def test_one_flipped_byte_names_its_block(tmp_path):
    a, b = _image(tmp_path / "a", 8 << 20), _image(tmp_path / "b", 8 << 20)
    faults.flip_byte(b, 0x5A3123)
    res = compare_images(a, b)
    assert not res.ok
    assert res.mismatched_blocks == 1
    assert res.as_dict()["first_mismatches"] == ["0x5a3000"]


def test_shorter_image_compares_as_zero_tail(tmp_path):
    a = tmp_path / "a"
    a.write_bytes(b"\1" * 4096 + b"\0" * 8192)
    b = tmp_path / "b"
    b.write_bytes(b"\1" * 4096)
    assert compare_images(a, b).ok


def test_stamped_blocks_found_and_payload_flipped(tmp_path):
    img = bytearray(64 * 4096)
    for blk in (3, 10, 40):
        img[blk * 4096:blk * 4096 + 8] = faults.VBLOCK_MAGIC
    p = tmp_path / "ram"
    p.write_bytes(bytes(img))
    assert faults.stamped_blocks(p) == [3 * 4096, 10 * 4096, 40 * 4096]
    assert faults.stamped_blocks(p, limit=20 * 4096) == [3 * 4096, 10 * 4096]
    off = faults.pick_stamped(p, 4)  # 4 % 3 = the second block
    assert off == 10 * 4096 + faults.PAYLOAD_OFFSET
    faults.flip_byte(p, off)
    data = p.read_bytes()
    assert data[off] == 0xFF and data[10 * 4096:10 * 4096 + 8] == faults.VBLOCK_MAGIC


def test_no_stamped_block_is_a_clear_error(tmp_path):
    p = _image(tmp_path / "ram", 16 * 4096, b"\0")
    with pytest.raises(LivemigError, match="verify:mem"):
        faults.pick_stamped(p, 0)


def test_magic_matches_the_guest_checker():
    root = Path(__file__).resolve().parents[2]
    src = (root / "guest/agent/agent.h").read_text()
    magic = struct.unpack("<Q", faults.VBLOCK_MAGIC)[0]
    assert f"{magic:#x}".lower() in src.lower()


def test_probe_gap_and_loss():
    st = ProbeStats()
    st.sent_at = [float(i) * 0.01 for i in range(100)]
    # replies to everything but probes 40..59 (a 0.2 s outage)
    st.replies = [(i * 0.01 + 0.001, i) for i in range(100) if not 40 <= i < 60]
    gap, start = st.longest_gap(0.0, 1.0)
    assert gap == pytest.approx(0.21, abs=1e-6) and start == pytest.approx(0.391)
    assert st.lost() == 20
    assert st.lost(excluding=(0.45, 0.62)) == 5  # probes 40..44 were sent before the hold
    assert st.replies_between(0.0, 0.3) == 30


def test_amplification_is_bytes_after_first_pass_over_guest_writes():
    st = MirrorStats(started=0.0, ready_at=1.0, offset_at_ready=100 << 20,
                     guest_written_at_ready=10 << 20, offset_final=180 << 20,
                     guest_written_final=20 << 20, finished_at=5.0)
    rep = st.as_report()
    assert rep["disk_transferred_bytes"] == 180 << 20
    assert rep["disk_dirty_amplification"] == 8.0
    assert rep["disk_detail"]["first_pass_s"] == 1.0


def test_tbf_bucket_holds_gso_packets_and_4ms():
    args = LinkShape(1_000_000_000).tbf_args()
    burst = int(args[args.index("burst") + 1])
    assert burst >= 256 << 10 and burst >= 125_000_000 // 250
    assert args[args.index("rate") + 1] == "1000000000bit"
