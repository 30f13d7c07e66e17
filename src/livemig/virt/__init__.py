"""livemig on libvirt: drive a libvirt domain's migration between two daemons.

Modules, one concern each:

- ``conn``: opening a libvirt connection (and reaching the testbed's daemons, whose
  addresses exist only inside the testbed's namespaces), one-line errors;
- ``plan``: livemig's profile and ``--set`` turned into libvirt flags, typed
  migration parameters and QMP passthrough (pure, unit-tested);
- ``qmp``: the monitor passthrough (``libvirt_qemu.qemuMonitorCommand``);
- ``run``: one migration: a thread blocked in ``migrateToURI3`` while the main loop
  polls ``jobStats()``, runs the policies, renews the throttle lease, aborts on
  Ctrl-C or ``--max-time`` and restores what it changed;
- ``stats``: ``jobStats()`` read once per poll into a policy snapshot and a sample;
- ``facts``: what the domain's XML and the daemons say (disks, emulator, host UUID),
  and the copied disks' comparison;
- ``record``: the report (same top-level keys as a lab run) and its summary;
- ``domain``: the lab's example domain XML (direct kernel boot of the guest image);
- ``cli``: ``livemig migrate --domain NAME --connect SRC_URI --to DST_URI``.
"""
