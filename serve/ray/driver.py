"""The driver actor of a launch: the control plane (pool), the scheduler and the serving
runtime — composed by :func:`tokenlake.serve.build.build` like a single-machine server, with
:class:`~tokenlake.serve.ray.engine.RayModelEngine` as its engine — and the HTTP API bound
to this node's cluster address."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial

import ray

log = logging.getLogger("tokenlake.launch")


@dataclass(frozen=True)
class DriverSpec:
    """What the launching process hands the driver actor (``options``: a
    :class:`~tokenlake.serve.ray.launch.LaunchOptions`)."""

    options: object
    launch_id: str
    groups: tuple
    node_ids: tuple[str, ...]  # per instance
    secret_paths: dict  # node id -> the node's secret file
    driver_node: str
    addresses: dict  # node id -> the node's cluster address (Ray's NodeManagerAddress)

    @property
    def all_nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.driver_node, *self.node_ids)))


def make_engine(spec: DriverSpec, node_ip: str, model, pool, closers: list):
    """``build``'s engine factory: the launch's actors and their data plane."""
    from tokenlake.engines.clusters.base import layout_for
    from tokenlake.engines.dataplane_config import DataPlaneConfig
    from tokenlake.serve.compute_program import ModelProgram, ModelSource
    from tokenlake.serve.ray.dataplane import DataPlaneSetup, RayDataPlane
    from tokenlake.serve.ray.engine import RayModelEngine

    o = spec.options
    s = o.serve
    rows = s.chunk_len * s.num_instances + s.max_num_seqs
    config = DataPlaneConfig(
        max_q_rows=rows,
        max_kv_rows=rows,
        timeout_s=o.timeout_s,
        startup_timeout_s=o.startup_timeout_s,
        separate_hosts=o.force_cross_node,
        host=node_ip,
    )
    source = ModelSource(s.model, s.dtype, s.seed)
    setup = DataPlaneSetup(
        spec.launch_id, spec.groups, spec.node_ids, spec.secret_paths[spec.driver_node],
        dict(spec.secret_paths), layout_for(pool.config, config, s.num_instances), config,
        s.kernel_backend, partial(ModelProgram, source), dict(spec.addresses), o.max_restarts,
        o.layout.cpus_per_instance, o.layout.gpus_per_instance, max(60.0, 6 * o.timeout_s),
    )  # fmt: skip
    dataplane = RayDataPlane(setup)
    closers.append(dataplane.close)
    return RayModelEngine(model, dataplane)


@ray.remote(num_cpus=0, max_concurrency=4)
class DriverActor:
    """Serves one launch; ``start`` returns the API's URL."""

    def __init__(self) -> None:
        self.spec: DriverSpec | None = None
        self._server = None

    def start(self, spec: DriverSpec) -> str:
        from tokenlake.logs import setup_logging
        from tokenlake.serve.api.http_server import HTTPServer
        from tokenlake.serve.build import build

        setup_logging(spec.options.log_level)
        self.spec = spec
        node_ip = spec.addresses[spec.driver_node]
        o = spec.options
        config = replace(o.serve, host=o.host or node_ip)
        served = build(config, engine_factory=partial(make_engine, spec, node_ip))
        try:
            self._server = HTTPServer(served, config.host, config.port).start()
        except BaseException:
            served.runtime.close()
            raise
        return self._server.url

    def status(self) -> dict:
        """Instances, their processes, nodes and sockets, lost instances (and when each was
        found dead), and the runtime's counters."""
        if self._server is None:
            return {"serving": False}
        runtime = self._server.served.runtime
        dp = runtime.engine.dataplane
        return {
            "serving": runtime.alive,
            "url": self._server.url,
            "pids": {f"{role}{i}": pid for (role, i), pid in dp.pids.items()},
            "process_nodes": {f"{role}{i}": node for (role, i), node in dp.nodes.items()},
            "endpoints": {f"{role}{i}": ep for (role, i), ep in dp.endpoints.items()},
            "nodes": list(self.spec.node_ids),
            "lost": sorted(dp.lost),
            "lost_at": {str(i): t for i, t in dp.lost_at.items()},
            "live": sorted(runtime.scheduler.pool.live_instances),
            "counters": dict(runtime.counters),
        }

    def record(self) -> dict:
        s = self.spec
        return {
            "launch_id": s.launch_id,
            "groups": list(s.groups),
            "node_ids": list(s.node_ids),
            "all_nodes": list(s.all_nodes),
        }

    def shutdown(self) -> None:
        """Stop serving; the runtime's close releases the data plane (actors killed)."""
        if self._server is not None:
            self._server.close()
            self._server = None
