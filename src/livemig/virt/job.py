"""libvirt's migration job as the engine's monitor sees a source QEMU.

libvirt runs the migration itself, in ``virDomainMigrateToURI3`` (a call that
blocks until it has ended: here in a thread of its own). The engine's monitor
(:class:`livemig.engine.monitor.Monitor`: the same loop, policies, stall watchdog
and limits as lab and attach runs) polls and cancels it through this adapter:

- ``query-migrate`` is answered from ``virDomainGetJobStats`` in QEMU's reply shape
  (:func:`livemig.virt.stats.query_migrate`) while the call runs, and from how the
  call ended once it has: ``completed``, ``cancelled`` (it was aborted) or
  ``failed`` with libvirt's message;
- ``migrate_cancel`` is ``virDomainAbortJob``, issued again every
  ``ABORT_RETRY_S`` until the call ends: an abort while libvirt still prepares the
  destination does not stop the migration;
- the call's end is the ``MIGRATION`` event that wakes the monitor.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from livemig.errors import VMError
from livemig.virt.conn import message
from livemig.virt.stats import query_migrate

ABORT_RETRY_S = 1.0


class DomainJob:
    def __init__(self, dom: Any, libvirt: Any, call: Callable[[], None],
                 throttle: Callable[[], int], event: Callable[..., None]) -> None:
        self.dom = dom
        self.libvirt = libvirt
        self.throttle = throttle  # the throttle livemig set (the executor's)
        self.event = event
        self.error: BaseException | None = None
        self.stats: dict[str, Any] | None = None  # the last poll's job statistics
        self.cancelling = False
        self._last_abort = 0.0

        def body() -> None:
            try:
                call()
            except BaseException as e:  # handed to the monitor as the job's end
                self.error = e
        self.thread = threading.Thread(target=body, name="libvirt-migrate", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def started(self) -> bool:
        return self.thread.ident is not None

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    async def cmd(self, command: str, **_args: Any) -> Any:
        if command == "query-migrate":
            return self._query()
        if command == "migrate_cancel":
            self.cancelling = True
            self._abort()
            return {}
        raise VMError(f"{command}: not a command of libvirt's migration job")

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The call's end, within ``timeout`` (libvirt's iteration events go to the
        run's events from libvirt's own event thread)."""
        await asyncio.to_thread(self.thread.join, max(0.0, timeout))
        return None if self.thread.is_alive() else {"event": "MIGRATION"}

    def ended(self) -> dict[str, Any]:
        """How the call ended, as QEMU's terminal ``query-migrate``."""
        if self.error is None:
            return {"status": "completed"}
        err = self.error
        why = message(err) if isinstance(err, self.libvirt.libvirtError) else repr(err)
        return {"status": "cancelled" if self.cancelling else "failed", "error-desc": why}

    def _query(self) -> dict[str, Any]:
        if not self.thread.is_alive():
            return self.ended()
        if self.cancelling and time.monotonic() - self._last_abort >= ABORT_RETRY_S:
            self._abort()
        try:
            stats: dict[str, Any] = self.dom.jobStats(0)
        except self.libvirt.libvirtError:
            stats = {}
        if stats.get("type", 0) == self.libvirt.VIR_DOMAIN_JOB_NONE:
            stats = {}
        self.stats = stats
        return query_migrate(stats, self.throttle(), self._postcopy())

    def _postcopy(self) -> bool:
        """The source paused for post-copy: the destination runs the guest."""
        try:
            state, reason = self.dom.state()
        except self.libvirt.libvirtError:
            return False
        return bool(state == self.libvirt.VIR_DOMAIN_PAUSED
                    and reason == self.libvirt.VIR_DOMAIN_PAUSED_POSTCOPY)

    def _abort(self) -> None:
        self._last_abort = time.monotonic()
        try:
            self.dom.abortJob()
        except self.libvirt.libvirtError as e:
            self.event("abortJob refused", error=message(e))
