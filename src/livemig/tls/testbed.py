"""TLS for lab runs: one PKI for the testbed's hosts, made once, next to its state.

Each host (``lm-src``, ``lm-dst``) gets its directory with its migration address as
a subject alternative name, so the source checks the destination's certificate
against the address it connects to, and the destination accepts only the other
testbed host's client certificate. ``--link local --tls on`` (both QEMUs on this
host, loopback) uses a ``localhost`` set for both ends.
"""

from __future__ import annotations

from pathlib import Path

from livemig import paths
from livemig.testbed import topology
from livemig.tls import creds, pki
from livemig.tls.creds import Tls

LOCAL = "local"


def _hosts() -> dict[str, pki.HostSpec]:
    hosts = {side: pki.HostSpec(topology.HOSTS[side], (topology.HOSTS[side],), (addr,))
             for side, addr in topology.MIG_ADDR.items()}
    hosts[LOCAL] = pki.HostSpec("localhost", ("localhost",), ("127.0.0.1",))
    return hosts


def pki_dir() -> Path:
    return paths.run_root() / "pki"


def host_dir(side: str) -> Path:
    return pki_dir() / _hosts()[side].name


def ensure() -> Path:
    """The lab's PKI, created where a host's set is missing."""
    missing = [h for side, h in _hosts().items() if not creds.has_creds(host_dir(side))]
    if missing:
        pki.init(pki_dir(), missing)
    return pki_dir()


def tls(src_side: str, dst_side: str) -> Tls:
    """Credentials for a migration from ``src_side`` to ``dst_side`` (or LOCAL)."""
    ensure()
    return Tls(src_dir=host_dir(src_side), dst_dir=host_dir(dst_side),
               peer=creds.client_identity(host_dir(src_side)),
               hostname=_hosts()[dst_side].ips[0])
