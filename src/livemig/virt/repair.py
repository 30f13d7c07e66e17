"""Putting back what a libvirt run set on a domain's QEMUs, from its journal
(``virt/journal.py``), when the run itself cannot: it died (kill -9, a crash).

Two callers: the run's guard (``virt/hold.py``), which does it as soon as no
migration job holds the domain any more, and the next livemig run for the domain,
should the guard not have been able to (a daemon unreachable for its whole wait).

What is put back, on the end where the domain runs now (a domain that is not active
on an end is left alone there):

- source: the migration parameters and capabilities livemig changed (their values
  before), the IO cap livemig may have put on the copied disks (disks that had none
  of their own: ``virt/actuator.py``), and the downtime limit it may have raised;
- destination: the stream parameters livemig set there through the domain XML.

The throttle needs nothing: its lease lapses within a second of livemig's death.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from livemig.errors import LivemigError
from livemig.virt import qmp
from livemig.virt.actuator import NO_IO_LIMITS


def put_back(record: Mapping[str, Any], dom_at: Callable[[str], Any | None],
             job_none: int) -> tuple[list[dict[str, Any]], list[str]]:
    """(what was put back, per end; the URIs where a job still holds the domain, so
    nothing could be done there yet). ``dom_at(uri)``: the domain on that end, or
    None; ``job_none``: libvirt's ``VIR_DOMAIN_JOB_NONE``."""
    ends = [(record.get("src_uri"), dict(record.get("params") or {}),
             dict(record.get("caps") or {}), list(record.get("io") or []),
             record.get("downtime_ms")),
            (record.get("dst_uri"), dict(record.get("dst_params") or {}), {}, [], None)]
    repaired: list[dict[str, Any]] = []
    waiting: list[str] = []
    for uri, params, caps, io, downtime in ends:
        if not uri or not (params or caps or io or downtime is not None):
            continue
        dom = dom_at(str(uri))
        if dom is None or not dom.isActive():
            continue
        if dom.jobInfo()[0] != job_none:
            waiting.append(str(uri))
            continue
        done: dict[str, Any] = {"uri": uri}
        if params:
            qmp.command(dom, "migrate-set-parameters", **params)
            done["parameters"] = params
        if caps:
            qmp.command(dom, "migrate-set-capabilities", capabilities=[
                {"capability": k, "state": v} for k, v in caps.items()])
            done["capabilities"] = caps
        for qdev in io:
            try:
                qmp.command(dom, "block_set_io_throttle", id=qdev, **NO_IO_LIMITS)
                done.setdefault("io_uncapped", []).append(qdev)
            except LivemigError:
                pass  # the device is gone (hot-unplugged): nothing to take off
        if downtime is not None and int(dom.migrateGetMaxDowntime(0)) != int(downtime):
            dom.migrateSetMaxDowntime(int(downtime), 0)
            done["downtime_ms"] = int(downtime)
        repaired.append(done)
    return repaired, waiting
