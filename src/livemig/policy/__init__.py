"""Convergence policies: small classes with a pure ``decide(snapshot) -> actions``.

Mechanism is QEMU's (patched or stock); what to do when is decided here, from the
stats QEMU reports, so every policy is unit-tested with recorded or synthetic
traces and can change without rebuilding QEMU.
"""
