"""In-place QEMU upgrade (CPR): replace a VM's QEMU process, guest RAM kept."""
