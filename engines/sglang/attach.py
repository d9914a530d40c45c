"""A worker joining a running host by name: what the control service's ``attach`` answers,
and the worker's :class:`.shared_runtime.WorkerAttachment` built from it.

A worker the host did not spawn (a separate SGLang server, or one of the scheduler processes
``--dp-size N`` starts) knows only the service's endpoint, the cluster secret's file and its
instance id (its ``--tokenlake-config``). It authenticates to the service with the secret and
asks for the rest: the data plane's layout and settings, the engines' endpoints, and the names
of the instances' shared memory segments (CPU; named buffers, ``MPCluster(named_buffers=True)``),
which it then maps. The secret itself never travels. Everything in the reply is plain msgpack,
checked here before use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from tokenlake.config import ModelShape
from tokenlake.engines.core.shared_buffers import InstanceBuffers, Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.errors import InvalidArgumentError

_ROLES = ("query", "transfer")


@dataclass(frozen=True)
class WorkerAttachment:
    """What a worker process needs to join a shared pool (handed over at spawn, one host)."""

    instance_id: int
    control_endpoint: str
    secret_path: str
    dataplane: DataPlaneConfig
    layout: Layout
    backend: str | None
    buffers: tuple[InstanceBuffers, ...]
    endpoints: dict[tuple[str, int], str]


def attach_info(cluster) -> dict:
    """The ``attach`` reply for ``cluster`` (an ``MPCluster`` with named buffers)."""
    buffers = getattr(cluster, "buffers", None)
    if not buffers or any(getattr(b, "segment_names", None) is None for b in buffers):
        raise InvalidArgumentError(
            "attach: the host's buffers are not named; start its MPCluster with "
            "named_buffers=True (CPU) for workers to join by name"
        )
    layout = asdict(cluster.layout)
    return {
        "layout": layout,
        "dataplane": asdict(cluster.config),
        "backend": cluster.backend or "",
        "buffers": [{"names": b.segment_names, "sizes": b.sizes()} for b in buffers],
        "endpoints": [[role, i, ep] for (role, i), ep in sorted(cluster.endpoints.items())],
    }


def attachment_from(info: object, instance_id: int, endpoint: str, secret_path: str):
    """The :class:`WorkerAttachment` of instance ``instance_id`` from an ``attach`` reply."""
    try:
        raw = _map(info, "attach reply")
        lay = _map(raw.get("layout"), "layout")
        model = ModelShape(**_map(lay.get("model"), "layout.model"))
        sizes = {k: v for k, v in lay.items() if k != "model"}
        for k, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"layout.{k}: expected a positive int, got {v!r}")
        layout = Layout(model, **sizes)
        dp = _map(raw.get("dataplane"), "dataplane")
        known = {f.name for f in fields(DataPlaneConfig)}
        dataplane = DataPlaneConfig(**{k: v for k, v in dp.items() if k in known})
        bufs = raw.get("buffers")
        if not isinstance(bufs, list) or len(bufs) != layout.num_instances:
            raise InvalidArgumentError(f"buffers: expected {layout.num_instances} entries")
        buffers = tuple(
            InstanceBuffers.attach(_map(b.get("names"), "names"), _map(b.get("sizes"), "sizes"))
            for b in map(lambda x: _map(x, "buffers[i]"), bufs)
        )
        for i, b in enumerate(buffers):
            problem = b.fits(layout)
            if problem is not None:
                raise InvalidArgumentError(f"buffers[{i}]: {problem}")
        endpoints = endpoints_from(raw, layout.num_instances)
        if not 0 <= instance_id < layout.num_instances:
            raise InvalidArgumentError(
                f"instance_id: expected 0..{layout.num_instances - 1}, got {instance_id}"
            )
    except (TypeError, ValueError, KeyError) as e:
        raise InvalidArgumentError(f"attach reply: malformed ({e})") from e
    backend = str(raw.get("backend") or "") or None
    return WorkerAttachment(instance_id, endpoint, secret_path, dataplane, layout, backend,
                            buffers, endpoints)  # fmt: skip


def endpoints_from(raw: dict, num_instances: int) -> dict[tuple[str, int], str]:
    """The engines' endpoints of an ``attach`` reply, by ``(role, instance_id)``."""
    endpoints = {}
    try:
        for entry in raw.get("endpoints") or []:
            role, i, ep = entry
            if role not in _ROLES or not 0 <= int(i) < num_instances:
                raise InvalidArgumentError(f"endpoints: unexpected entry {entry!r}")
            endpoints[(str(role), int(i))] = str(ep)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"attach reply: malformed endpoints ({e})") from e
    return endpoints


def _map(value: object, name: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{name}: expected a map, got {type(value).__name__}")
    return value
