"""``livemig install-qemu``: the project's QEMU installed so that a libvirt domain can
name it as its ``<emulator>`` with no extra arguments (docs/install.md).

- ``firmware``: which firmware files the installed QEMU finds, and how (symbolic
  links into the Debian packages' directories, in the order Debian's QEMU searches);
  the boot check that proves it (``q35`` started with no ``-L``);
- ``apparmor``: the lines the distribution's libvirt confinement needs for a QEMU
  outside ``/usr/bin``;
- ``qemu``: install, verify, uninstall (a manifest names what livemig put there);
- ``cli``: the subcommand.
"""
