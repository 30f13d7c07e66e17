"""``livemig doctor URI``: can this libvirt host take part in an evacuation?

- ``facts``: what was gathered (frozen dataclasses), nothing else;
- ``checks``: facts -> one finding per line (``ok``/``warn``/``fail``), pure;
- ``gather``: the facts from libvirt and, when the host's files are visible here,
  from its emulator (a throwaway ``-machine none`` QEMU) and its configuration;
- ``gate``: the ``fail`` findings alone, and whether the emulator is a stock QEMU,
  for a command that checks hosts before it starts
  (``examine(uri, emulator, tls_required)``);
- ``cli``: the subcommand.
"""
