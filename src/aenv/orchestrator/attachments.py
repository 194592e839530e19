"""What a sandbox record says about its network and volumes, and what its spec gets of them.

The record keeps E2B's network config as accepted (`network`: allowOut, denyOut, dnsServers,
allowPublicTraffic, maskRequestHost) and its volume mounts (`volume_mounts`: name, volume id,
path); `egress_of` and `volume_specs` turn them into the runtime's `EgressPolicy` and
`VolumeMount`s. Pure functions of their inputs (the volume manager is passed in).
"""

from __future__ import annotations

from typing import Any, Protocol

from aenv.errors import AenvError, ErrorCode, invalid
from aenv.runtime.base import VolumeMount
from aenv.runtime.container.mounts import check_mount_path
from aenv.runtime.egress import ALL_TRAFFIC, EgressPolicy, parse_policy

MAX_VOLUME_MOUNTS = 16
# Fields of E2B's network config this server does not implement: refused, not ignored (each
# would change where traffic goes or what it carries).
_UNSUPPORTED = {"egressProxy": "an egress SOCKS5 proxy", "rules": "per-domain transform rules",
                "httpsPorts": "HTTPS upstream ports"}
_EGRESS_FIELDS = ("allowOut", "denyOut", "dnsServers")


class Volumes(Protocol):
    """What the manager needs of `orchestrator.volumes.VolumeManager`."""

    def by_name(self, name: str) -> Any: ...

    def get(self, volume_id: str) -> Any: ...

    def data_dir(self, volume_id: str) -> Any: ...


def _refuse_unsupported(network: dict[str, Any]) -> None:
    for key, what in _UNSUPPORTED.items():
        if network.get(key) not in (None, [], {}):
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            f"network.{key} ({what}) is not supported by this server")


def create_network(network: dict[str, Any] | None, allow_internet_access: bool
                   ) -> tuple[dict[str, Any], bool]:
    """A create's network config as the record keeps it, and whether the sandbox gets a
    network interface. `allow_internet_access: false` alone keeps the sandbox without one
    (loopback only, as before); with allowOut it becomes denyOut 0.0.0.0/0 (E2B's meaning)
    on an interface, so that the allowed destinations are reachable."""
    raw = dict(network or {})
    _refuse_unsupported(raw)
    kept: dict[str, Any] = {k: raw[k] for k in (*_EGRESS_FIELDS, "allowPublicTraffic",
                                                  "maskRequestHost") if raw.get(k) is not None}
    interface = allow_internet_access
    if not allow_internet_access and kept.get("allowOut"):
        kept["denyOut"] = [*kept.get("denyOut", []), ALL_TRAFFIC]
        interface = True
    egress_of(kept)  # validated now: a bad rule is the create's 400
    mask = kept.get("maskRequestHost")
    if mask is not None and (not isinstance(mask, str) or len(mask) > 253
                             or any(c in mask for c in "\r\n\0 ")):
        raise invalid("network.maskRequestHost: a host name, optionally with ${PORT}")
    return kept, interface


def deny_all(network: dict[str, Any]) -> dict[str, Any]:
    """`network` with 0.0.0.0/0 denied (what `allow_internet_access: false` means)."""
    deny = list(network.get("denyOut", []))
    return {**network, "denyOut": deny if ALL_TRAFFIC in deny else [*deny, ALL_TRAFFIC]}


def updated_network(current: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`PUT /sandboxes/{id}/network`: the egress fields are replaced as a whole (omitted ones
    cleared, as E2B does); allowPublicTraffic and maskRequestHost stay."""
    _refuse_unsupported(update)
    out = {k: v for k, v in current.items() if k not in _EGRESS_FIELDS}
    out.update({k: update[k] for k in _EGRESS_FIELDS if update.get(k) is not None})
    if update.get("allow_internet_access") is False:
        out["denyOut"] = [*out.get("denyOut", []), ALL_TRAFFIC]
    egress_of(out)
    return out


def egress_of(network: dict[str, Any]) -> EgressPolicy | None:
    """The runtime policy of a record's network config (None: nothing is refused)."""
    policy = parse_policy(network.get("allowOut"), network.get("denyOut"),
                          network.get("dnsServers"))
    return policy if policy.active else None


def resolve_mounts(volumes: Volumes | None, mounts: list[tuple[str, str]]
                   ) -> list[dict[str, str]]:
    """A create's `volumeMounts` (volume name, path) as the record keeps them."""
    if not mounts:
        return []
    if volumes is None:
        raise AenvError(ErrorCode.NOT_SUPPORTED, "volumes are not enabled on this server")
    if len(mounts) > MAX_VOLUME_MOUNTS:
        raise invalid(f"volumeMounts: at most {MAX_VOLUME_MOUNTS}")
    out: list[dict[str, str]] = []
    paths: set[str] = set()
    for name, path in mounts:
        path = check_mount_path(path)
        if any(path == p or path.startswith(p + "/") or p.startswith(path + "/")
               for p in paths):
            raise invalid(f"volumeMounts: {path} overlaps another mount")
        paths.add(path)
        rec = volumes.by_name(name)
        out.append({"name": rec.name, "volumeID": rec.volume_id, "path": path})
    return out


def volume_specs(volumes: Volumes | None, mounts: list[dict[str, str]]
                 ) -> tuple[VolumeMount, ...]:
    """The record's mounts as the runtime's; NOT_FOUND for a volume deleted meanwhile."""
    if not mounts:
        return ()
    if volumes is None:
        raise AenvError(ErrorCode.NOT_SUPPORTED, "volumes are not enabled on this server")
    out = []
    for mount in mounts:
        volumes.get(mount["volumeID"])
        out.append(VolumeMount(path=mount["path"], source=volumes.data_dir(mount["volumeID"])))
    return tuple(out)
