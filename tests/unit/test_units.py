import pytest

from livemig.errors import UsageError
from livemig.units import fmt_bytes, parse_link_rate, parse_size


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("4K", 4096), ("64M", 64 << 20), ("1G", 1 << 30), ("1.5G", 3 << 29),
    ("2MiB", 2 << 20), ("8k", 8192),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "M", "-1M", "1X", "one"])
def test_parse_size_bad(bad):
    with pytest.raises(UsageError):
        parse_size(bad)


def test_link_rates():
    assert parse_link_rate("100mbit") == 100_000_000
    assert parse_link_rate("1gbit") == 1_000_000_000
    assert parse_link_rate("none") is None
    with pytest.raises(UsageError):
        parse_link_rate("fast")


def test_fmt_bytes():
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 << 20) == "3.0 MiB"
    assert fmt_bytes(None) == "-"
