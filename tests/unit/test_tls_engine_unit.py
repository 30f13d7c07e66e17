"""TLS objects and parameters on both ends (scripted QMP): added before the
migration, reset and deleted after it whatever the outcome, also by the guardian."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from fakeqmp import FakeEnd
from livemig.engine.guardian import repair_ends
from livemig.engine.negotiate import EndSettings
from livemig.engine.plan import Plan
from livemig.engine.run import Engine
from livemig.errors import UsageError, VMError
from livemig.tls import creds, pki
from livemig.tls.creds import Tls

URI = "tcp:10.77.0.2:4444"
FAST = (("poll-interval", "0.01"),)
TLS = Tls(Path("/pki/lm-src"), Path("/pki/lm-dst"), "O=livemig,CN=lm-src", "10.77.0.2")
TLS_OFF = {"tls-creds": "", "tls-hostname": "", "tls-authz": ""}


class TlsEnd(FakeEnd):
    """A FakeEnd with QOM objects and the tls-* parameters; ``gnutls=False`` answers
    object-add as a QEMU built without GnuTLS does."""

    def __init__(self, *a: Any, gnutls: bool = True, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.params.update(TLS_OFF)
        self.objects: dict[str, dict[str, Any]] = {"other": {"qom-type": "iothread"}}
        self.gnutls = gnutls

    async def cmd(self, command: str, **args: Any) -> Any:
        if command == "object-add":
            self.log.append((command, args))
            if not self.gnutls and args["qom-type"] == "tls-creds-x509":
                raise VMError(f"{self.name}: object-add: TLS credentials support requires "
                              "GNUTLS")
            if args["id"] in self.objects:
                raise VMError(f"{self.name}: attempt to add duplicate property")
            self.objects[args["id"]] = dict(args)
            return {}
        if command == "object-del":
            self.log.append((command, args))
            self.objects.pop(args["id"])
            return {}
        if command == "qom-list":
            self.log.append((command, args))
            return [{"name": n, "type": "child<x>"} for n in self.objects]
        return await super().cmd(command, **args)


def ends(**src_kw: Any) -> tuple[TlsEnd, TlsEnd]:
    src = TlsEnd("src", **src_kw)
    dst = TlsEnd("dst", status="inmigrate")
    dst.events.append({"event": "MIGRATION", "data": {"status": "completed"},
                       "timestamp": {"seconds": 1, "microseconds": 0}})
    return src, dst


def plan(**kw: Any) -> Plan:
    return Plan(URI, settings=(("multifd", "on"), *FAST), profile="defaults",
                verify=False, tls=TLS, **kw).validate()


def test_completed_run_adds_then_removes_the_objects_on_both_ends() -> None:
    src, dst = ends()
    rec = asyncio.run(Engine(src, dst, plan()).run())
    assert rec.outcome == "completed", rec.reason
    [s_obj] = src.called("object-add")
    assert s_obj == {"qom-type": "tls-creds-x509", "id": "livemig-tls-creds",
                     "dir": "/pki/lm-src", "endpoint": "client", "verify-peer": True}
    d_creds, d_authz = dst.called("object-add")
    assert d_creds["endpoint"] == "server" and d_creds["verify-peer"] is True
    assert d_creds["dir"] == "/pki/lm-dst"
    assert d_authz == {"qom-type": "authz-simple", "id": "livemig-tls-authz",
                       "identity": "O=livemig,CN=lm-src"}
    # set with the other parameters, before migrate-incoming and migrate
    s_set = next(a for a in src.called("migrate-set-parameters") if "tls-creds" in a)
    assert s_set["tls-creds"] == "livemig-tls-creds" and s_set["tls-hostname"] == "10.77.0.2"
    d_set = next(a for a in dst.called("migrate-set-parameters") if "tls-creds" in a)
    assert d_set["tls-authz"] == "livemig-tls-authz"
    names = [c for c, _ in dst.log]
    assert names.index("object-add") < names.index("migrate-incoming")
    # afterwards: both ends as before, the user's own object untouched
    for end in (src, dst):
        assert {k: end.params[k] for k in TLS_OFF} == TLS_OFF
        assert set(end.objects) == {"other"}
    assert rec.restored["destination"]["objects_deleted"] == ["livemig-tls-creds",
                                                             "livemig-tls-authz"]


def test_failed_migration_removes_them_too_and_the_source_runs() -> None:
    src, dst = ends(statuses=["active", "failed"])
    rec = asyncio.run(Engine(src, dst, plan()).run())
    assert rec.outcome == "failed"
    assert src.status == "running" and not dst.called("cont")
    for end in (src, dst):
        assert {k: end.params[k] for k in TLS_OFF} == TLS_OFF
        assert set(end.objects) == {"other"}


def test_a_qemu_without_gnutls_fails_before_migrate_and_leaves_nothing() -> None:
    src, dst = ends(gnutls=False)
    rec = asyncio.run(Engine(src, dst, plan()).run())
    assert rec.outcome == "failed" and "without GnuTLS" in (rec.reason or "")
    assert "--tls off" in (rec.reason or "")
    assert not src.called("migrate") and not dst.called("migrate-incoming")
    assert src.status == "running"
    for end in (src, dst):
        assert set(end.objects) == {"other"}
        assert {k: end.params[k] for k in TLS_OFF} == TLS_OFF


def test_without_tls_nothing_is_added() -> None:
    src, dst = ends()
    p = Plan(URI, settings=FAST, profile="defaults", verify=False).validate()
    rec = asyncio.run(Engine(src, dst, p).run())
    assert rec.outcome == "completed", rec.reason
    assert not src.called("object-add") and not dst.called("object-add")
    assert all("tls-creds" not in a for a in src.called("migrate-set-parameters"))


def test_guardian_deletes_the_objects_of_a_dead_run() -> None:
    src, dst = ends()
    spec = {"original_src": EndSettings(dict(src.caps), dict(src.params)).as_dict(),
            "original_dst": EndSettings(dict(dst.caps), dict(dst.params)).as_dict()}
    src.objects["livemig-tls-creds"] = {}
    src.params["tls-creds"] = "livemig-tls-creds"
    dst.objects.update({"livemig-tls-creds": {}, "livemig-tls-authz": {}})
    dst.params.update({"tls-creds": "livemig-tls-creds", "tls-authz": "livemig-tls-authz"})
    asyncio.run(repair_ends(src, dst, spec))
    for end in (src, dst):
        assert set(end.objects) == {"other"}
        assert {k: end.params[k] for k in TLS_OFF} == TLS_OFF


def test_set_tls_parameters_by_hand_is_refused() -> None:
    with pytest.raises(UsageError, match="--tls"):
        Plan(URI, settings=(("tls-creds", "x"),), explicit=frozenset({"tls-creds"})
             ).validate()


@pytest.mark.parametrize(("mode", "one_host", "on"), [
    ("auto", True, False), ("auto", False, True), ("on", True, True),
    ("off", False, False)])
def test_enabled(mode: str, one_host: bool, on: bool) -> None:
    assert creds.enabled(mode, one_host) is on


def test_attach_tls_auto_follows_the_uri(tmp_path: Path) -> None:
    pki.init(tmp_path, pki.parse_hosts("h"))
    d = tmp_path / "h"
    assert creds.attach_tls("auto", d, "tcp:127.0.0.1:4444") is None
    assert creds.attach_tls("auto", d, "unix:/run/m.sock") is None
    t = creds.attach_tls("auto", d, "tcp:10.0.0.2:4444")
    assert t is not None and t.peer == "O=livemig,CN=h" and t.dst_dir == d
    assert creds.attach_tls("on", d, "unix:/run/m.sock") is not None
    with pytest.raises(UsageError, match="bad --tls"):
        creds.enabled("maybe", False)


def test_attach_without_credentials_is_a_one_line_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from livemig.cli import main

    args = ["migrate", "--src-qmp", str(tmp_path / "s"), "--dst-qmp", str(tmp_path / "d"),
            "--uri", "tcp:10.0.0.2:4444", "--tls-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "missing ca-cert.pem" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main([*args[:-2], "--tls", "bogus"])
    assert e.value.code == 2


def test_libvirt_tls_flag_follows_the_request() -> None:
    from livemig.virt import plan as P

    qemu = P.QemuInfo(frozenset({"multifd"}), {"multifd-channels": 2}, frozenset())
    on = P.make_plan({}, frozenset(), qemu, P.Request(tls=True, storage="copy",
                                                      tls_destination="10.77.0.2"))
    off = P.make_plan({}, frozenset(), qemu, P.Request(tls_destination="10.77.0.2"))
    assert on.flags & P.TLS and "tls" in on.flag_names()
    # the name the destination's certificate is checked against, NBD copy included
    assert on.params[P.P_TLS_DESTINATION] == "10.77.0.2"
    assert not off.flags & P.TLS and P.P_TLS_DESTINATION not in off.params


@pytest.mark.parametrize(("src", "dst", "one"), [
    ("qemu:///system", "qemu+unix:///system", True),
    ("qemu+tls://10.77.0.1/system", "qemu+tls://10.77.0.2/system?pkipath=/x", False),
    ("qemu+tcp://localhost/system", "qemu:///system", True),
    ("qemu+ssh://a/system", "qemu+ssh://a/system", True)])
def test_libvirt_one_host(src: str, dst: str, one: bool) -> None:
    assert creds.libvirt_one_host(src, dst) is one


def test_the_encoding_model_counts_tls_per_byte_sent() -> None:
    from livemig.policy import encoding as E

    plain, zstd = E.Codec(ratio=1.0, speed=E.PLAIN_SPEED), E.Codec(ratio=4.0, speed=3e8)
    off, on = E.Context(link_rate=None, cpus=1.0), E.Context(link_rate=None, cpus=1.0,
                                                             tls=True)
    assert E.page_rate(plain, on) < E.page_rate(plain, off)
    # TLS costs per byte sent: a codec sending a quarter of the bytes loses less
    loss_plain = 1 - E.page_rate(plain, on) / E.page_rate(plain, off)
    loss_zstd = 1 - E.page_rate(zstd, on) / E.page_rate(zstd, off)
    assert 0 < loss_zstd < loss_plain
    # a link-bound stream does not change
    slow = E.Context(link_rate=50e6, cpus=1.0)
    assert E.page_rate(plain, slow) == E.page_rate(plain, E.Context(link_rate=50e6, tls=True))
