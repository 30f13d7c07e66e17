"""The migration engine: drives ONE migration between two QMP endpoints.

It knows nothing of how the two QEMUs were started. Data flows one way::

    Plan (validated, frozen) ─▶ Endpoint ×2 ─▶ negotiate ─▶ Monitor loop ─▶ Decision
        ─▶ verify (frozen source vs paused destination) ─▶ MigrationRecord (immutable)

Callers: the lab (``livemig.lab``: boots guests on the testbed, then hands the two
QMP sockets to the engine) and attach (``livemig migrate --src-qmp/--dst-qmp``).
"""
