import pytest

from livemig.accel import choose_accel, kvm_usable
from livemig.errors import UsageError


def test_no_dev_kvm(tmp_path):
    assert "does not exist" in kvm_usable(tmp_path / "cpuinfo", tmp_path / "kvm")


def test_no_hw_virt_flags(tmp_path):
    cpu = tmp_path / "cpuinfo"
    cpu.write_text("flags\t: fpu sse2 avx\n")
    dev = tmp_path / "kvm"
    dev.write_text("")
    assert "no vmx/svm" in kvm_usable(cpu, dev)
    cpu.write_text("flags\t: fpu vmx sse2\n")
    assert kvm_usable(cpu, dev) is None


def test_choose():
    assert choose_accel("tcg").name == "tcg"
    assert choose_accel("auto").name in ("tcg", "kvm")
    with pytest.raises(UsageError):
        choose_accel("xen")


def test_multi_vcpu_tcg_guests_run_round_robin():
    from livemig.lab.vm import accel_arg

    assert accel_arg("tcg", 2) == "tcg,thread=single"
    assert accel_arg("tcg", 1) == "tcg"
    assert accel_arg("kvm", 4) == "kvm"
