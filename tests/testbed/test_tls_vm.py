"""TLS on the testbed with real guests: a rogue client that reaches the destination's
incoming port before the source is refused, and the real migration still completes
with the RAM verified; without TLS the same first connection takes the destination.

QEMU 10.2 (migration/tls.c) only logs a failed incoming TLS handshake (bad
certificate, an identity tls-authz refuses, or no TLS at all) and keeps listening,
so the source's connection that follows is taken as the migration. Without TLS the
first connection *is* the migration stream (plain QEMU_VM_FILE_MAGIC), so a rogue
sender owns the incoming side.

LIVEMIG_TEST_QEMU names another QEMU binary (one built with GnuTLS, which
tls-creds-x509 needs) instead of build/qemu.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest

from conftest import QEMU
from livemig.lab.run import LabRun, MigrateOptions
from livemig.settings import merge
from livemig.spec import parse_workload
from livemig.testbed import netns, topology
from livemig.tls import pki
from livemig.tls import testbed as tls_testbed

pytestmark = [pytest.mark.vm, pytest.mark.testbed]
TEST_QEMU = Path(os.environ.get("LIVEMIG_TEST_QEMU", str(QEMU)))
# QEMU's file magic and version 3: what a real source sends first
QEVM = b"QEVM\x00\x00\x00\x03"
REPLY_WAIT_S = 5.0


def _read_until_closed(s: socket.socket | ssl.SSLSocket) -> str:
    """What the destination did with us: closed the connection, or kept it open."""
    s.settimeout(REPLY_WAIT_S)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return "open"
    except (ssl.SSLError, OSError) as e:
        return f"closed: {type(e).__name__}: {e}"
    return "closed"


def _garbage(addr: str, port: int) -> str:
    with socket.create_connection((addr, port), timeout=REPLY_WAIT_S) as s:
        s.sendall(QEVM + os.urandom(4096))
        return _read_until_closed(s)


def _tls_client(addr: str, port: int, cert_dir: Path) -> str:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the rogue does not care who the server is
    ctx.load_cert_chain(cert_dir / "client-cert.pem", cert_dir / "client-key.pem")
    try:
        with socket.create_connection((addr, port), timeout=REPLY_WAIT_S) as raw, \
                ctx.wrap_socket(raw) as s:
            s.sendall(QEVM + os.urandom(4096))
            return _read_until_closed(s)
    except (ssl.SSLError, OSError) as e:
        return f"closed: {type(e).__name__}: {e}"


class RogueFirst(LabRun):
    """A lab run whose destination gets rogue connections before ``migrate``."""

    def __init__(self, opts: MigrateOptions, rogues: dict[str, Any]) -> None:
        super().__init__(opts)
        self.rogues = rogues
        self.results: dict[str, str] = {}

    async def warmup(self) -> None:  # migrate-incoming is done, migrate not yet
        assert self.engine is not None
        host, port = self.engine.plan.uri[4:].rsplit(":", 1)
        for name, attempt in self.rogues.items():
            self.results[name] = await asyncio.to_thread(
                netns.call_in, topology.HOSTS["src"],
                lambda a=attempt: a(host, int(port)))  # type: ignore[misc]
        await super().warmup()


def _opts(tls: str) -> MigrateOptions:
    return MigrateOptions(
        workload=parse_workload("mem:size=128M,rate=16M"), memory=512 << 20,
        wanted=merge("livemig", {"warmup": "1", "encoding": "plain"}), qemu=TEST_QEMU,
        accel="tcg", accel_reason="test", max_time=180.0, tls=tls,
        keep_run_dir=True)  # the destination's log says why it refused each rogue


def test_rogue_first_connections_are_refused_and_the_migration_completes(
        tmp_path: Path) -> None:
    tls_testbed.ensure()
    foreign = pki.init(tmp_path / "foreign", pki.parse_hosts("lm-src=10.77.0.1"))[0]
    wrong_peer = tls_testbed.host_dir("dst")  # the right CA, but not the source's DN
    rogues = {
        "garbage": _garbage,
        "foreign CA, the source's name": lambda h, p: _tls_client(h, p, foreign),
        "our CA, another identity": lambda h, p: _tls_client(h, p, wrong_peer),
    }
    run = RogueFirst(_opts("on"), rogues)
    try:
        rec = asyncio.run(run.run())
        dst_log = run.dst.config.log_path.read_text(errors="replace") if run.dst else ""
    finally:
        shutil.rmtree(run.run_dir, ignore_errors=True)
    print("rogues:", run.results)
    assert rec.completed, (rec.reason, run.results, dst_log[-2000:])
    assert rec.ram is not None and rec.ram.result == "ok"
    assert set(run.results) == set(rogues)
    for name, result in run.results.items():
        assert result.startswith("closed"), (name, result)
    # QEMU said why it refused each: no TLS, a certificate not from the CA, the authz
    assert "authz check for O=livemig,CN=lm-dst is denied" in dst_log, dst_log[-2000:]
    assert rec.plan is not None and rec.plan.tls is not None
    assert run.report()["consistency"]["ram"] == "ok"


def test_without_tls_a_rogue_first_connection_takes_the_destination(tmp_path: Path) -> None:
    run = RogueFirst(_opts("off"), {"garbage": _garbage})
    try:
        rec = asyncio.run(run.run())
    finally:
        shutil.rmtree(run.run_dir, ignore_errors=True)
    print("without TLS:", run.results, rec.outcome, rec.reason)
    assert not rec.completed
    assert run.results["garbage"] == "open"  # the destination took it as the stream
    # the source keeps the guest
    assert rec.source_after is not None and rec.source_after.get("running") is True
