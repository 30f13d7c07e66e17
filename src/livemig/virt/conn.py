"""Opening libvirt connections, with one-line errors.

The testbed's daemons listen on 10.77.0.1 and 10.77.0.2, addresses that exist only
inside the testbed's namespaces (nothing is routed into them from this machine's
own network). A ``qemu+tcp://`` URI naming one of them is therefore opened from a
thread inside that host's namespace; the socket stays there and the connection can
be used from any thread afterwards. Any other URI is opened as given.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from typing import Any

from livemig.errors import LivemigError, SetupError, UsageError

log = logging.getLogger(__name__)


class LibvirtError(LivemigError):
    """libvirt refused or failed an operation (its message, one line)."""


def libvirt_module() -> Any:
    try:
        import libvirt  # type: ignore[import-untyped]
    except ImportError:
        raise SetupError("the libvirt Python binding is missing: make venv (it builds "
                         "libvirt-python against libvirt-dev; make deps installs that)"
                         ) from None
    # libvirt prints every error to stderr by default; livemig reports its own
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    _start_event_loop(libvirt)
    return libvirt


_event_loop: threading.Thread | None = None


def _start_event_loop(libvirt: Any) -> None:
    """libvirt's default event loop in a daemon thread, registered before the first
    connection opens: a client that calls into one connection from two threads (the
    migration call and the polls) needs it for keepalive and I/O dispatch; without
    it a poll was seen to block for as long as the migration call ran."""
    global _event_loop
    if _event_loop is not None:
        return
    libvirt.virEventRegisterDefaultImpl()

    def loop() -> None:
        while True:
            libvirt.virEventRunDefaultImpl()

    _event_loop = threading.Thread(target=loop, name="libvirt-events", daemon=True)
    _event_loop.start()


def message(e: Exception) -> str:
    """libvirt's own message of an error, on one line."""
    get = getattr(e, "get_error_message", None)
    text = get() if callable(get) else None
    return " ".join(str(text or e).split())


def on_this_host(uri: str) -> bool:
    """The daemon ``uri`` names runs on this machine: a URI without a host
    (``qemu:///system``, ``qemu+unix://``) or one of the testbed's daemons."""
    try:
        host = urllib.parse.urlsplit(uri).hostname
    except ValueError:
        return False
    return not host or testbed_side(uri) is not None


def testbed_side(uri: str) -> str | None:
    """``src``/``dst`` when ``uri`` names one of the testbed's daemons and it is up."""
    try:
        host = urllib.parse.urlsplit(uri).hostname
    except ValueError:
        return None
    if not host:
        return None
    from livemig.testbed import libvirtd, topology

    side = libvirtd.side_of_address(host)
    if side is None or not topology.is_up():
        return None
    return side


def open_uri(uri: str, what: str) -> Any:
    """A read-write connection to ``uri``; ``what`` names it in errors."""
    libvirt = libvirt_module()
    if "://" not in uri:
        raise UsageError(f"{what} {uri!r} is not a libvirt URI (e.g. qemu+tcp://HOST/system)")
    side = testbed_side(uri)
    try:
        if side is not None:
            from livemig.testbed import netns, topology

            log.info("opening %s inside the testbed's %s namespace", uri, side)
            return netns.call_in(topology.HOSTS[side], lambda: libvirt.open(uri))
        return libvirt.open(uri)
    except libvirt.libvirtError as e:
        raise LibvirtError(f"cannot connect to {what} {uri}: {message(e)}") from None


def lookup(conn: Any, name: str, uri: str) -> Any:
    libvirt = libvirt_module()
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError as e:
        if e.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
            raise UsageError(f"no domain {name!r} on {uri}") from None
        raise LibvirtError(f"domain {name!r} on {uri}: {message(e)}") from None


def find(conn: Any, name: str) -> Any | None:
    """The domain or None (no error when it does not exist)."""
    libvirt = libvirt_module()
    try:
        return conn.lookupByName(name)
    except libvirt.libvirtError:
        return None
