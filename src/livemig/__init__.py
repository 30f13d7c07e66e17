"""livemig: live migration of QEMU/KVM virtual machines that converges under load.

Mechanism lives in a QEMU patch series (qemu/), policy lives here, in the control plane.
"""

__version__ = "0.1.0"
