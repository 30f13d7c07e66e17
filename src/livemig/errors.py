"""The exception hierarchy: one root class, so the CLI can turn any of them into a
one-line message instead of a traceback."""


class LivemigError(Exception):
    """Root of every error livemig raises on purpose."""

    exit_code = 1


class UsageError(LivemigError):
    """Bad options, specs or settings given by the user (exit status 2)."""

    exit_code = 2


class SetupError(LivemigError):
    """Something livemig needs is missing: QEMU build, guest image, permissions."""

    exit_code = 2


class VMError(LivemigError):
    """A QEMU process failed to start, died or stopped answering."""


class FaultInjectionRefused(UsageError):
    """A fault-injection option was given without explicitly allowing it."""
