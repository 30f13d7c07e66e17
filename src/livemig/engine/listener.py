"""A destination that never held the guest is quit, so its incoming port closes.

After ``migrate-incoming`` the destination listens on the migration port until a
stream completes. QEMU 10.2 has no way to close that listener short of quitting:
``migrate_cancel`` acts on the outgoing side only (``migration_cancel`` works on
``MigrationState``, not on the incoming state), ``yank`` shuts connected channels,
not the listening socket, and a second ``migrate-incoming`` is refused ("The
incoming migration has already been started": a QEMU accepts it once in its life).
A connection that sends nothing, or garbage, fails the incoming migration but
leaves the port open (tried on 10.2.2: a second connection is still accepted).

So after an abort or a failure, a destination that is still ``inmigrate`` (it never
loaded a guest, let alone ran one) with its incoming migration in ``setup`` (no
source ever connected) or ``failed``/``cancelled`` is of no further use: it can
never take another migration, holds no guest, and leaves a port open on which
anyone who reaches it can start a stream. It is quit. This applies to a
destination the user started for this migration too (attach ``--dst-qmp``): the
rule "a VM livemig did not start is never killed" is about guests, and this QEMU
has none; the run's events say so (``destination quit``).

Left alone: a destination that never got ``migrate-incoming`` (``none``: it can
still take a migration), one still loading (``active``: the source may have
completed), and one that loaded (``paused``/``running``, e.g. held after a failed
comparison: the guest's state is there for its owner to look at).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from livemig.errors import LivemigError

UNUSED_INCOMING = frozenset({"setup", "failed", "cancelled"})
# After the source's cancel its stream ends and the destination's incoming migration
# turns ``failed`` within milliseconds; 5 s covers a loaded host. A destination whose
# link is down stays ``active`` (no FIN arrives): it is left alone after this wait.
SETTLE_S = 5.0
POLL_S = 0.1


async def quit_unused_destination(dst: Any, say: Callable[[str], None]) -> bool:
    """Quit ``dst`` (a connected QMP end) if it never held the guest and listens in
    vain; True when it was quit. ``say`` gets one line describing what was done."""
    deadline = time.monotonic() + SETTLE_S
    try:
        while True:
            if (await dst.cmd("query-status")).get("status") != "inmigrate":
                return False
            incoming = str((await dst.cmd("query-migrate")).get("status", "none"))
            if incoming in UNUSED_INCOMING:
                break
            if incoming != "active" or time.monotonic() > deadline:
                return False
            await asyncio.sleep(POLL_S)
    except (LivemigError, OSError):
        return False
    with contextlib.suppress(LivemigError, OSError):  # the connection goes with QEMU
        await dst.cmd("quit")
    say(f"destination quit: it never held the guest (incoming migration {incoming}) and "
        "QEMU cannot close its incoming port otherwise")
    return True
