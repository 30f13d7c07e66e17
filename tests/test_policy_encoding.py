"""The stream-encoding choice, fed with synthetic page pairs."""

from __future__ import annotations

import random

from livemig.policy.encoding import ENCODINGS, KEYS, changed_share, choose
from livemig.settings import resolve

rng = random.Random(7)
TEXT = (b"INSERT INTO orders VALUES (42, 'widget', 3.50); " * 100)[:4096]


def _small_delta(page: bytes) -> bytes:
    b = bytearray(page)
    off = rng.randrange(4096 - 64)
    b[off:off + 64] = rng.randbytes(64)
    return bytes(b)


def test_small_rewrites_choose_xbzrle():
    pairs = [(p, _small_delta(p)) for p in (rng.randbytes(4096) for _ in range(40))]
    c = choose(pairs)
    assert c.encoding == "xbzrle" and c.changed_share is not None and c.changed_share < 0.02


def test_whole_compressible_pages_choose_lz4():
    pairs = [(rng.randbytes(4096), TEXT[i:] + TEXT[:i]) for i in range(40)]
    c = choose(pairs)
    assert c.encoding == "lz4" and c.ratio is not None and c.ratio > 3


def test_whole_random_pages_choose_plain():
    pairs = [(rng.randbytes(4096), rng.randbytes(4096)) for _ in range(40)]
    assert choose(pairs).encoding == "plain"


def test_too_few_samples_fall_back_to_the_default():
    c = choose([(b"a" * 4096, b"b" * 4096)])
    assert c.encoding == "xbzrle" and "only 1" in c.reason


def test_changed_share_and_settings():
    assert changed_share(b"\0" * 4096, b"\0" * 4095 + b"\1") == 1 / 4096
    for enc in ENCODINGS.values():
        assert set(enc) <= KEYS
    assert ENCODINGS["lz4"]["multifd-compression"] == "lz4"


def test_lz4_delta_is_lz4_multifd_with_the_delta_cache():
    enc = ENCODINGS["lz4-delta"]
    assert enc["multifd"] == "on" and enc["xbzrle"] == "off"
    assert enc["multifd-compression"] == "lz4"
    assert enc["x-multifd-lz4-delta-cache-size"] == "256M"
    # the patched QEMU reports the parameter as a size: --set takes 256M
    r = resolve({"encoding": "lz4-delta", **enc}, {"multifd": False, "xbzrle": False},
                {"multifd-compression": "none", "multifd-channels": 2,
                 "x-multifd-lz4-delta-cache-size": 0})
    assert r.livemig["encoding"] == "lz4-delta"
    assert r.parameters["x-multifd-lz4-delta-cache-size"] == 256 << 20
