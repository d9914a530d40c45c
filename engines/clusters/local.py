"""In-process data plane: N instances in one process, each with its own buffers and a query
engine object. The same engine clients and the same engines as the multi-process cluster;
requests travel through :class:`~tokenlake.engines.transport.sockets.LocalChannel` instead of
sockets (the fast test double, and the embedded default).
"""

from __future__ import annotations

import dataclasses

import torch

from tokenlake.engines.client.driver import Driver
from tokenlake.engines.clusters.base import ClusterBase, host_tier, layout_for, pool_config
from tokenlake.engines.core.engine_base import EngineHost
from tokenlake.engines.core.query_engine import QueryEngine
from tokenlake.engines.core.shared_buffers import InstanceBuffers
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport.sockets import LocalChannel


class LocalCluster(ClusterBase):
    """``config.num_instances`` in-process instances (``config``: a ``PoolConfig``, or a
    ``Pool`` whose config is read once).

    ``dataplane`` sizes the per-instance q/kv buffers; by default they hold as many rows as
    the pool holds tokens (a plan never needs more), allocated lazily by the OS. ``buffers``
    (one per instance, laid out for ``dataplane``): storage shared with other processes
    instead, so that a worker process reads every instance's segments in place
    (:mod:`tokenlake.engines.clusters.instance_worker`).
    """

    def __init__(
        self,
        config,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        dataplane: DataPlaneConfig | None = None,
        buffers: dict[int, InstanceBuffers] | None = None,
    ) -> None:
        cfg = pool_config(config)
        n = cfg.num_instances
        if dataplane is None:
            rows = max(1, min(cfg.capacity_tokens, 1 << 22))
            dataplane = DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows)
        dataplane = dataclasses.replace(dataplane, device=torch.device(device).type)
        layout = layout_for(cfg, dataplane, n)
        if buffers is None:
            buffers = {
                i: InstanceBuffers.allocate(layout.nbytes(), device, shared=False) for i in range(n)
            }
        engines = {
            ("query", i): QueryEngine(EngineHost(i, n, buffers, dataplane.timeout_s))
            for i in range(n)
        }
        self.config = cfg
        self._driver = Driver(dataplane, n, LocalChannel(engines))
        self._driver.configure(list(engines), layout, backend)
        self._driver.views = {i: b.views(layout) for i, b in buffers.items()}
        self._driver.tier = host_tier(cfg, device)
        self.kv_pools = [self._driver.views[i].pool for i in range(n)]
        self._engines = engines
        self._make_clients(n)

    def engine_stats(self) -> dict[tuple[str, int], dict[str, int]]:
        """Every query engine's counters by ``(role, instance_id)`` and this process's
        clients' under ``("client", -1)``, as :meth:`MPCluster.engine_stats`."""
        out = {key: dict(engine.stats) for key, engine in self._engines.items()}
        out[("client", -1)] = dict(self._driver.stats)
        return out
