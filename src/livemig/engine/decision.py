"""What the monitor loop does after each poll: one enum, one reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    CONTINUE = "continue"
    CANCEL = "cancel"  # migrate_cancel; the source runs on
    POSTCOPY = "postcopy"  # migrate-start-postcopy was issued
    FORCE = "force"  # the strategy is exhausted; switch over whatever it costs


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""


CONTINUE = Verdict(Decision.CONTINUE)
