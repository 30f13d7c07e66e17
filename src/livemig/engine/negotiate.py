"""Settings: read both ends, resolve the plan against them, apply, and put back.

The original capabilities and parameters of both ends are remembered before
anything is changed; :func:`restore` sets back every one that differs at the end,
whatever the outcome (also what the policies changed on the way: downtime limit,
bandwidth, the throttle knob). With TLS (``plan.tls``) both ends get their
``livemig-tls-*`` credential objects and the ``tls-*`` parameters (:mod:`livemig.tls.qmp`);
the restore sets the ``tls-*`` parameters back and deletes those objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from livemig.engine.endpoint import QmpEnd
from livemig.engine.plan import Plan
from livemig.errors import UsageError, VMError
from livemig.settings import Resolved, resolve
from livemig.tls import qmp as tls_qmp
from livemig.tls.creds import Tls

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

# parameters QEMU reports but refuses to be given back as they are:
# block-bitmap-mapping is a list (the tls-* strings go back like the others, "" = off)
_NOT_RESTORED = frozenset({"block-bitmap-mapping"})


@dataclass(frozen=True)
class EndSettings:
    capabilities: dict[str, bool]
    parameters: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"capabilities": dict(self.capabilities), "parameters": dict(self.parameters)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EndSettings:
        return cls(dict(d.get("capabilities", {})), dict(d.get("parameters", {})))


@dataclass(frozen=True)
class Negotiated:
    resolved: Resolved
    capabilities: dict[str, bool]  # what is set on both ends
    parameters: dict[str, Any]
    original_src: EndSettings
    original_dst: EndSettings
    tls: Tls | None = None
    # what the plan would have set had the destination QEMU had it (the source's has)
    unused: tuple[str, ...] = ()


async def read(end: QmpEnd) -> EndSettings:
    caps = {c["capability"]: bool(c["state"])
            for c in await end.cmd("query-migrate-capabilities")}
    params = dict(await end.cmd("query-migrate-parameters"))
    return EndSettings(caps, params)


def shared(s: EndSettings, d: EndSettings) -> EndSettings:
    """What both QEMUs know: the capabilities and parameters the source has that the
    destination has too (the source's values). A stream uses a capability only when
    both ends have it, so a patched source migrating to a stock destination (a host
    not yet upgraded, or rolled back) keeps to stock's mechanisms."""
    return EndSettings({k: v for k, v in s.capabilities.items() if k in d.capabilities},
                       {k: v for k, v in s.parameters.items() if k in d.parameters})


def source_only(s: EndSettings, d: EndSettings) -> list[str]:
    """The source's capabilities and parameters the destination lacks, sorted."""
    return sorted({*(k for k in s.capabilities if k not in d.capabilities),
                   *(k for k in s.parameters if k not in d.parameters)})


async def negotiate(src: QmpEnd, dst: QmpEnd, plan: Plan,
                    src_now: EndSettings | None = None) -> Negotiated:
    """Resolve the plan against what both QEMUs have (:func:`shared`); a setting the
    user named that only the source has is a usage error naming the destination."""
    s = src_now or await read(src)
    d = await read(dst)
    wanted = plan.wanted
    if plan.bandwidth is not None:
        wanted["max-bandwidth"] = str(plan.bandwidth)
    missing = source_only(s, d)
    named = [k for k in missing if k in wanted]
    if named:
        raise UsageError(f"--set {named[0]}: the destination QEMU has no {named[0]} "
                         "(the source's has; is the destination the patched build?)")
    both = shared(s, d)
    resolved = resolve(wanted, both.capabilities, both.parameters)
    unused: tuple[str, ...] = ()
    if missing:  # what the plan would have set, had the destination had it too
        alone = resolve(wanted, s.capabilities, s.parameters)
        unused = tuple(k for k in missing
                       if k in alone.capabilities or k in alone.parameters)
    # 'events' makes QEMU emit MIGRATION / MIGRATION_PASS: their timestamps time the
    # switchover and mark rounds
    caps = {"events": True, **resolved.capabilities}
    if plan.pause_before_switchover:
        caps["pause-before-switchover"] = True
    return Negotiated(resolved, caps, dict(resolved.parameters), s, d, plan.tls, unused)


async def apply(src: QmpEnd, dst: QmpEnd, n: Negotiated) -> None:
    """Both ends get the same capabilities and parameters (QEMU requires it for
    multifd, compression and most capabilities); with TLS, each its own side's
    credentials (the source a client's, the destination a server's and the authz)."""
    for side, end, orig in (("src", src, n.original_src), ("dst", dst, n.original_dst)):
        caps = [{"capability": k, "state": v} for k, v in n.capabilities.items()
                if orig.capabilities.get(k) != v]
        if caps:
            await end.cmd("migrate-set-capabilities", capabilities=caps)
        params = dict(n.parameters)
        if n.tls is not None:
            await tls_qmp.add(end, n.tls, side)
            params.update(tls_qmp.parameters(n.tls, side))
        if params:
            await end.cmd("migrate-set-parameters", **params)


async def restore(end: QmpEnd, original: EndSettings) -> dict[str, Any]:
    """Set back every capability and parameter that differs from ``original``.

    Returns what was restored (and what could not be). Each parameter that QEMU
    refuses alone is retried one by one, so one refusal does not keep the rest."""
    done: dict[str, Any] = {"capabilities": {}, "parameters": {}, "errors": []}
    now = await read(end)
    params = {k: v for k, v in original.parameters.items()
              if k not in _NOT_RESTORED and k in now.parameters and now.parameters[k] != v}
    if params:
        try:
            await end.cmd("migrate-set-parameters", **params)
            done["parameters"] = params
        except VMError:
            for k, v in params.items():
                try:
                    await end.cmd("migrate-set-parameters", **{k: v})
                    done["parameters"][k] = v
                except VMError as e:
                    done["errors"].append(f"{k}: {e}")
    caps = {k: v for k, v in original.capabilities.items()
            if k in now.capabilities and now.capabilities[k] != v}
    if caps:
        # switch capabilities off before others on: QEMU checks combinations per call
        order = sorted(caps.items(), key=lambda kv: kv[1])
        try:
            await end.cmd("migrate-set-capabilities", capabilities=[
                {"capability": k, "state": v} for k, v in order])
            done["capabilities"] = caps
        except VMError:
            for k, v in order:
                try:
                    await end.cmd("migrate-set-capabilities",
                                  capabilities=[{"capability": k, "state": v}])
                    done["capabilities"][k] = v
                except VMError as e:
                    done["errors"].append(f"{k}: {e}")
    objects = await tls_qmp.remove_objects(end)  # after tls-creds no longer names them
    if objects:
        done["objects_deleted"] = objects
    return done
