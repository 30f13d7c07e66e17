"""From a host's facts to findings, one line each: pure, unit-tested without libvirt.

A ``fail`` means the host cannot take part in an evacuation with livemig's defaults
(no emulator libvirt can drive, not a QEMU, no TLS credentials while migrations are
encrypted, no room for a guest); a ``warn`` that it can, with less than livemig
offers or with something unchecked (a remote host's files).
"""

from __future__ import annotations

from dataclasses import dataclass

from livemig.doctor.facts import HostFacts, QemuFacts
from livemig.engine.verify import DIGEST_CMD
from livemig.sampling.qemu import START as SAMPLE_CMD
from livemig.settings import DRAIN_CAP, SWITCH_CAP
from livemig.tls.creds import CLIENT_FILES, SERVER_FILES
from livemig.virt.plan import DELTA_KEY, LZ4_MARK, RAM_CHECK_CAP, THROTTLE_COMMAND

OK, WARN, FAIL = "ok", "warn", "fail"
# the versions livemig is tested with (docs/libvirt-runs.md): bookworm's libvirt and
# the QEMU release the patch series is on; older ones are not refused, only flagged
TESTED_LIBVIRT = (9, 0, 0)
TESTED_QEMU = (10, 2, 0)
# a host with less free memory takes no guest at all: the smallest guest the testbed
# migrates has 128 MiB, and its destination QEMU needs about as much again of its own
MIN_FREE_BYTES = 512 << 20
# below this share of its memory free a destination has no headroom: every incoming
# guest needs its whole RAM there before the switchover, and the host's page cache
# and the migration's buffers come on top
WARN_FREE_FRACTION = 0.10
# the patched build's mechanisms (qemu/patches), each by the QMP name virt/ and the
# engine use to detect it: (name, kind, QMP name)
MECHANISMS = (
    ("direct throttle", "command", THROTTLE_COMMAND),
    ("lz4 multifd", "parameter", LZ4_MARK),
    ("hot-page deferral", "parameter", "x-hot-page-defer-percent"),
    ("RAM digest", "command", DIGEST_CMD),
    ("delta encoding", "parameter", DELTA_KEY),
    ("in-stream RAM check", "capability", RAM_CHECK_CAP),
    ("switchover drain", "capability", DRAIN_CAP),
    ("page sampler", "command", SAMPLE_CMD),
    ("codec switch", "capability", SWITCH_CAP),
)


@dataclass(frozen=True)
class Finding:
    level: str  # ok | warn | fail
    what: str
    detail: str

    def line(self) -> str:
        return f"{self.level:<5} {self.what:<10} {self.detail}"


def version_text(v: int | None) -> str:
    if v is None:
        return "unknown"
    return f"{v // 1_000_000}.{v // 1000 % 1000}.{v % 1000}"


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _libvirt(f: HostFacts) -> Finding:
    v = version_text(f.libvirt_version)
    if f.libvirt_version is None:
        return Finding(WARN, "libvirt", "version unknown (the daemon did not say)")
    where = f" on {f.hostname}" if f.hostname else ""
    if version_tuple(v) < TESTED_LIBVIRT:
        return Finding(WARN, "libvirt", f"{v}{where}: older than livemig is tested with "
                       f"({'.'.join(map(str, TESTED_LIBVIRT))})")
    return Finding(OK, "libvirt", f"{v}{where}")


def _emulator(f: HostFacts) -> Finding:
    if f.emulator is None:
        return Finding(FAIL, "emulator", f"libvirt names no x86_64 emulator "
                       f"({f.domcaps_error or 'no domain capabilities'}): install QEMU "
                       "(livemig install-qemu) and check it with --emulator PATH")
    if f.domcaps_error:
        return Finding(FAIL, "emulator", f"{f.emulator}: libvirt cannot drive it "
                       f"({f.domcaps_error})")
    how = "--emulator" if f.emulator_given else "libvirt's default"
    return Finding(OK, "emulator", f"{f.emulator} ({how}; libvirt describes it)")


def _qemu_version(f: HostFacts, q: QemuFacts | None) -> Finding | None:
    text = q.version if q and q.version else (
        version_text(f.hypervisor_version) if f.hypervisor_version else None)
    if text is None:
        return None
    if version_tuple(text) < TESTED_QEMU:
        return Finding(WARN, "qemu", f"{text}: older than livemig is tested with "
                       f"({'.'.join(map(str, TESTED_QEMU))})")
    return Finding(OK, "qemu", text)


def _mechanisms(q: QemuFacts) -> Finding:
    names = {"command": q.commands, "parameter": q.parameters,
             "capability": q.capabilities}
    have = [m for m, kind, key in MECHANISMS if key in names[kind]]
    lacking = [m for m, kind, key in MECHANISMS if key not in names[kind]]
    if not lacking:
        return Finding(OK, "mechanisms", f"patched build: {', '.join(have)}")
    if not have:
        return Finding(WARN, "mechanisms", "stock QEMU: migrations use QEMU's own "
                       "mechanisms (auto-converge, stock codecs, no RAM digest); for "
                       "livemig's: livemig install-qemu on this host")
    return Finding(WARN, "mechanisms", f"a partial build: has {', '.join(have)}; lacks "
                   f"{', '.join(lacking)} (rebuild: make qemu, then livemig install-qemu)")


def _firmware(q: QemuFacts) -> Finding:
    if q.firmware_error is None:
        return Finding(OK, "firmware", "a q35 machine starts with no -L")
    return Finding(WARN, "firmware", f"a q35 machine does not start without -L "
                   f"({q.firmware_error}): domains need <qemu:arg value='-L'/> firmware "
                   "directories; or livemig install-qemu and name PREFIX/bin/"
                   "qemu-system-x86_64 as their <emulator>")


def _qemu(f: HostFacts) -> list[Finding]:
    q = f.qemu
    if q is None:
        if f.emulator is None:
            return []
        v = _qemu_version(f, None)
        return [*([v] if v else []),
                Finding(WARN, "mechanisms", "not checked: the emulator is on another host "
                        "(run livemig doctor qemu:///system there)")]
    if q.error:
        return [Finding(FAIL, "qemu", f"{q.path}: {q.error}")]
    out = [x for x in (_qemu_version(f, q),) if x]
    out += [_mechanisms(q), _firmware(q)]
    if f.tls_required and not q.gnutls:
        out.append(Finding(FAIL, "qemu", f"{q.path} was built without GnuTLS: it cannot "
                           "encrypt migrations (rebuild with make qemu, or migrate with "
                           "--tls off)"))
    return out


def _tls(f: HostFacts) -> Finding:
    if not f.tls_required:
        return Finding(OK, "tls", "not required (--tls off)")
    if f.tls_missing is None:
        return Finding(WARN, "tls", "not checked: the daemon's certificates are on "
                       "another host (run livemig doctor there)")
    if f.tls_missing:
        return Finding(FAIL, "tls", f"{f.tls_dir}: missing {', '.join(f.tls_missing)} "
                       "(libvirt's migrate_tls_x509_cert_dir): livemig pki init, copy the "
                       "host's directory there; or migrate with --tls off")
    n = len(set(SERVER_FILES + CLIENT_FILES))
    return Finding(OK, "tls", f"{f.tls_dir}: the {n} migration certificate files")


def _kvm(f: HostFacts) -> Finding:
    if f.local and f.kvm_problem:
        return Finding(WARN, "kvm", f"TCG only: {f.kvm_problem}; guests run, far slower")
    if f.libvirt_kvm is False:
        return Finding(WARN, "kvm", "TCG only: libvirt offers no kvm domains for this "
                       "emulator (/dev/kvm missing or not usable)")
    if f.libvirt_kvm is None and not f.local:
        return Finding(WARN, "kvm", "unknown")
    return Finding(OK, "kvm", "usable" + ("" if f.local else " (as libvirt says)"))


def _memory(f: HostFacts) -> Finding:
    if f.free_memory is None:
        return Finding(WARN, "memory", "free memory unknown")
    gib = f.free_memory / (1 << 30)
    total = f" of {f.total_memory / (1 << 30):.1f} GiB" if f.total_memory else ""
    if f.free_memory < MIN_FREE_BYTES:
        return Finding(FAIL, "memory", f"{gib:.2f} GiB free{total}: no room for a guest "
                       f"(at least {MIN_FREE_BYTES >> 20} MiB)")
    if f.total_memory and f.free_memory < WARN_FREE_FRACTION * f.total_memory:
        return Finding(WARN, "memory", f"{gib:.1f} GiB free{total}: little headroom for "
                       "incoming guests")
    return Finding(OK, "memory", f"{gib:.1f} GiB free{total}")


def _confinement(f: HostFacts) -> Finding | None:
    if f.confined is None:
        return None
    if not f.confined:
        return Finding(OK, "apparmor", "QEMU is not confined here (AppArmor off, its "
                       "libvirt profiles absent, or security_driver none)")
    if f.confinement_allows:
        return Finding(OK, "apparmor", f"libvirt's profiles allow {f.emulator}")
    return Finding(FAIL, "apparmor", f"libvirt's AppArmor profiles do not allow "
                   f"{f.emulator}: domains naming it fail to start (livemig install-qemu "
                   "writes the rules; docs/install.md)")


def _domains(f: HostFacts) -> Finding:
    if f.running is None:
        return Finding(WARN, "domains", "running domains unknown")
    return Finding(OK, "domains", f"{f.running} running")


def check(f: HostFacts) -> list[Finding]:
    """Every finding for ``f``, in a fixed order."""
    out = [_libvirt(f), _emulator(f)]
    out += _qemu(f)
    c = _confinement(f)
    out += [c] if c else []
    out += [_tls(f), _kvm(f), _memory(f), _domains(f)]
    return out


def can_take_part(findings: list[Finding]) -> bool:
    return not any(x.level == FAIL for x in findings)
