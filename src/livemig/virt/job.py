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
- the call's end is the ``MIGRATION`` event that wakes the monitor, and libvirt's
  migration-iteration events (QEMU's ``MIGRATION_PASS``, handed over by
  :meth:`DomainJob.passed` from libvirt's event thread) are its ``MIGRATION_PASS``.

A cancelled job whose call does not return is over all the same once the source
QEMU's own migration has ended (``cancelled`` or ``failed``: it can no longer
complete) and the domain runs on the source: on a dead link libvirt's rollback
waits for its peer-to-peer connection to the destination daemon to time out
(over 60 s seen), while the guest already runs on. After ``DETACH_AFTER_S`` the
job then reads as ended; the call is left to libvirt's daemon, which finishes its
rollback on its own. A source QEMU still ``cancelling`` then (its threads blocked
on the dead link: a send with TLS and multifd, the return path) is yanked first
(QMP ``yank`` of its migration channels, through the passthrough).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from livemig.errors import VMError
from livemig.virt.conn import message
from livemig.virt.stats import PageRate, query_migrate

ABORT_RETRY_S = 1.0
# a cancelled job's call may take this long to return before the source QEMU's own
# migration status decides (libvirt's abort and rollback take a second or two)
DETACH_AFTER_S = 5.0


class DomainJob:
    def __init__(self, dom: Any, libvirt: Any, call: Callable[[], None],
                 throttle: Callable[[], int], event: Callable[..., None], *,
                 postcopy: bool = False,
                 qemu_migration: Callable[[], Any] | None = None,
                 yank: Callable[[], Any] | None = None) -> None:
        self.dom = dom
        self.libvirt = libvirt
        self.throttle = throttle  # the throttle livemig set (the executor's)
        self.event = event
        # the call may switch to post-copy (VIR_MIGRATE_POSTCOPY): only then is the
        # domain's state read at each poll
        self.postcopy = postcopy
        # the source QEMU's own query-migrate (libvirt's monitor passthrough)
        self.qemu_migration = qemu_migration
        self.yank = yank  # QMP yank of the source QEMU's migration channels
        self.yanked = False
        self.error: BaseException | None = None
        self.stats: dict[str, Any] | None = None  # the last poll's job statistics
        self._pages = PageRate()  # QEMU's pages-per-second, which libvirt does not pass on
        self.detached: str | None = None  # the source QEMU's status, once left to libvirt
        self._first_abort: float | None = None
        self._last_abort = 0.0
        # set by the call's end and by each round's start (libvirt's event thread)
        self._wake = threading.Event()
        self._passes: list[int] = []

        def body() -> None:
            try:
                call()
            except BaseException as e:  # handed to the monitor as the job's end
                self.error = e
            finally:
                self._wake.set()
        self.thread = threading.Thread(target=body, name="libvirt-migrate", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def started(self) -> bool:
        return self.thread.ident is not None

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    @property
    def _ended(self) -> bool:
        return self.started and not self.thread.is_alive()

    @property
    def cancelling(self) -> bool:
        """``migrate_cancel`` was asked."""
        return self._first_abort is not None

    async def cmd(self, command: str, **_args: Any) -> Any:
        if command == "query-migrate":
            return self._query()
        if command == "migrate_cancel":
            self._abort()
            return {}
        raise VMError(f"{command}: not a command of libvirt's migration job")

    def passed(self, iteration: int) -> None:
        """libvirt's migration-iteration event (its event thread; the run has
        recorded the round): the monitor sees it as ``MIGRATION_PASS``."""
        self._passes.append(iteration)
        self._wake.set()

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The call's end or a round's start, within ``timeout``."""
        if not self._passes and not self._ended:
            await asyncio.to_thread(self._wake.wait, max(0.0, timeout))
        self._wake.clear()  # a pass set after the wait is in _passes all the same
        if self._ended:
            return {"event": "MIGRATION"}
        if self._passes:
            return {"event": "MIGRATION_PASS", "data": {"pass": self._passes.pop(0)},
                    "recorded": True}
        return None

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
        if self.detached is None and self.cancelling:
            over = self._after_abort()
            if over is not None:
                self.detached = over
                self.event("left to libvirt", qemu_status=over, reason="the source QEMU's "
                           "migration has ended and the domain runs on the source; "
                           "libvirt's call has not returned (its rollback waits on the "
                           "destination)")
        if self.detached is not None:
            return {"status": "cancelled" if self.detached == "cancelled" else "failed",
                    "error-desc": f"the source QEMU's migration {self.detached}; "
                                  "libvirt's call had not returned"}
        if self.cancelling and time.monotonic() - self._last_abort >= ABORT_RETRY_S:
            self._abort()
        try:
            stats: dict[str, Any] = self.dom.jobStats(0)
        except self.libvirt.libvirtError:
            stats = {}
        if stats.get("type", 0) == self.libvirt.VIR_DOMAIN_JOB_NONE:
            stats = {}
        self.stats = stats
        return query_migrate(stats, self.throttle(), self._postcopy(),
                             self._pages.update(stats))

    def _postcopy(self) -> bool:
        """The source paused for post-copy: the destination runs the guest."""
        if not self.postcopy:
            return False
        try:
            state, reason = self.dom.state()
        except self.libvirt.libvirtError:
            return False
        return bool(state == self.libvirt.VIR_DOMAIN_PAUSED
                    and reason == self.libvirt.VIR_DOMAIN_PAUSED_POSTCOPY)

    def _after_abort(self) -> str | None:
        """``DETACH_AFTER_S`` after the first abort: ``cancelled`` or ``failed`` when
        the source QEMU's migration has ended so and the domain runs; else None, and a
        source QEMU still ``cancelling`` is yanked (once)."""
        first = self._first_abort
        if self.qemu_migration is None or first is None \
                or time.monotonic() - first < DETACH_AFTER_S:
            return None
        try:
            status = str((self.qemu_migration() or {}).get("status"))
            state, _ = self.dom.state()
        except Exception:  # libvirt or the passthrough refused: not known, wait on
            return None
        if status in ("cancelled", "failed") and state == self.libvirt.VIR_DOMAIN_RUNNING:
            return status
        if status == "cancelling" and self.yank is not None and not self.yanked:
            # QEMU's threads are blocked on the dead link (a send, the return path):
            # its yank shuts the migration channels down, as the engine's switchover
            # watch does for lab and attach runs
            self.yanked = True
            try:
                self.yank()
                self.event("yanked", reason="the source QEMU was still cancelling "
                           f"{DETACH_AFTER_S:g} s after the abort")
            except Exception as e:  # said, and the wait goes on
                self.event("yank failed", error=str(e))
        return None

    def _abort(self) -> None:
        if self._first_abort is None:
            self._first_abort = time.monotonic()
        self._last_abort = time.monotonic()
        try:
            self.dom.abortJob()
        except self.libvirt.libvirtError as e:
            self.event("abortJob refused", error=message(e))
