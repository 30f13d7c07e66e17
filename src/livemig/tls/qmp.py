"""The QMP side of TLS for one migration: objects and parameters on both ends.

The destination gets a ``tls-creds-x509`` object with ``endpoint=server`` and
``verify-peer=on`` (the source must show a certificate from the CA) and an
``authz-simple`` object that accepts one identity: the source's client certificate's
distinguished name. The source gets ``endpoint=client`` (it checks the server's
certificate against ``tls-hostname`` or the URI's host). Multifd channels take the
same credentials. Everything is named ``livemig-tls-*``, so the restore (also the
guardian's, if livemig dies) finds and deletes exactly what livemig added.
"""

from __future__ import annotations

import contextlib
from typing import Any

from livemig.engine.endpoint import QmpEnd
from livemig.errors import VMError
from livemig.tls.creds import Tls

PREFIX = "livemig-tls-"
CREDS_ID = PREFIX + "creds"
AUTHZ_ID = PREFIX + "authz"
PARAMS = ("tls-creds", "tls-hostname", "tls-authz")


def objects(tls: Tls, side: str) -> list[dict[str, Any]]:
    """The ``object-add`` arguments for ``side`` (src or dst)."""
    if side == "src":
        return [{"qom-type": "tls-creds-x509", "id": CREDS_ID, "dir": str(tls.src_dir),
                 "endpoint": "client", "verify-peer": True}]
    return [{"qom-type": "tls-creds-x509", "id": CREDS_ID, "dir": str(tls.dst_dir),
             "endpoint": "server", "verify-peer": True},
            {"qom-type": "authz-simple", "id": AUTHZ_ID, "identity": tls.peer}]


def parameters(tls: Tls, side: str) -> dict[str, str]:
    """The ``migrate-set-parameters`` for ``side``."""
    if side == "src":
        return {"tls-creds": CREDS_ID, "tls-hostname": tls.hostname}
    return {"tls-creds": CREDS_ID, "tls-authz": AUTHZ_ID}


async def add(end: QmpEnd, tls: Tls, side: str) -> None:
    """Add ``side``'s objects (leftovers of a dead run with the same ids first go)."""
    await remove_objects(end)
    for obj in objects(tls, side):
        try:
            await end.cmd("object-add", **obj)
        except VMError as e:
            if "GNUTLS" in str(e).upper():
                raise VMError(f"{end.name}: this QEMU was built without GnuTLS, so it "
                              "cannot encrypt migrations: rebuild it (make setup: "
                              "qemu/build.sh configures --enable-gnutls) or pass --tls off"
                              ) from None
            raise VMError(f"{end.name}: TLS credentials from {obj.get('dir', '')}: "
                          f"{e}") from None


async def remove_objects(end: QmpEnd) -> list[str]:
    """Delete every ``livemig-tls-*`` object of ``end``; returns their ids."""
    try:
        listed = await end.cmd("qom-list", path="/objects")
    except VMError:
        return []
    gone = []
    for obj in listed:
        name = str(obj.get("name", ""))
        if name.startswith(PREFIX):
            with contextlib.suppress(VMError):
                await end.cmd("object-del", id=name)
                gone.append(name)
    return gone
