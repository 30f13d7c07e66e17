"""Page samplers: what the encoding model sees of a guest's memory, from any QEMU.

A sampler takes two looks at the same random guest pages a moment apart and reduces
them to a :class:`livemig.policy.encoding.Sample` (counts and codec measurements, no
page content). One interface, several ways to read a guest, chosen by what the QEMU
offers (:func:`livemig.engine.adapt.sampler_for`):

- :class:`~livemig.sampling.qemu.QemuSampler`: the patched QEMU's
  ``x-calc-ram-sample`` / ``x-query-ram-sample`` (QEMU samples and measures the codecs
  itself in a thread; nothing but numbers crosses QMP);
- :class:`~livemig.sampling.peek.PeekSampler`: any QEMU: the RAM layout from HMP
  ``info mtree -f``, pages read in small clusters through a reader — ``pmemsave``
  into a private file for a QEMU on this host, HMP ``xp`` otherwise, or libvirt's
  ``virDomainMemoryPeek`` for a domain;
- the lab's RAM-file reader (:mod:`livemig.lab.pagesample`), for lab runs that ask for
  it (``--set sampler=file``).
"""

from livemig.sampling.base import Sampler, SampleResult

__all__ = ["SampleResult", "Sampler"]
