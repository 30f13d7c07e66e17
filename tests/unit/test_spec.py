import pytest

from livemig.errors import UsageError
from livemig.spec import parse_workload


def test_full_mem_spec():
    w = parse_workload("mem:size=512M,rate=200M,hot=80/10,fill=text,touch=128,threads=2")
    (m,) = w.mem
    assert m.size == 512 << 20
    assert m.rate == 200 << 20
    assert (m.hot_percent, m.hot_fraction) == (80, 10)
    assert m.fill == "text" and m.touch == 128 and m.threads == 2 and m.after == 0
    assert parse_workload("mem:touch=128,after=12").mem[0].after == 12
    assert w.mem_bytes == 512 << 20


def test_defaults_and_combination():
    w = parse_workload("mem:zipf=1.2+disk:bs=8K,rate=2M+verify:mem=64M,disk=32M")
    assert w.mem[0].zipf == 1.2 and w.mem[0].fill == "mixed" and w.mem[0].touch == 64
    assert w.disk[0].bs == 8192 and w.disk[0].rate == 2 << 20 and w.disk[0].dev == "/dev/vda"
    assert w.verify is not None and w.verify.mem == 64 << 20 and w.verify.rate == 8 << 20
    assert parse_workload("verify:mem=1M,rate=1M").verify.rate == 1 << 20
    assert w.mem_bytes == (256 << 20) + (64 << 20)


def test_idle():
    w = parse_workload("idle")
    assert w.is_idle and w.mem_bytes == 0


@pytest.mark.parametrize("bad", [
    "", "mem:size", "mem:size=12Q", "mem:hot=80", "mem:hot=0/10", "mem:hot=80/10,zipf=1",
    "mem:fill=sparse", "mem:colour=red", "disk:bs=1000", "disk:dev=vda", "cpu:x=1",
    "idle:x=1", "verify:", "verify:mem=1M+verify:mem=1M", "mem:size=1M,size=2M",
    "mem:size=1 M", "mem:touch=5000", "mem:after=-1", "mem:after=3601",
])
def test_bad_specs_are_one_line_errors(bad):
    with pytest.raises(UsageError) as e:
        parse_workload(bad)
    assert "\n" not in str(e.value)
