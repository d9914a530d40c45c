"""What both transports' clusters share: the layout of a pool on the data plane and the
set of engine clients a process holds (one per instance it drives)."""

from __future__ import annotations

from tokenlake.config import PoolConfig
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.client.engine_client import EngineClient
from tokenlake.engines.core.host_tier import HostTierStore
from tokenlake.engines.core.shared_buffers import Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.errors import InvalidArgumentError
from tokenlake.validate import check_int


def pool_config(source: object) -> PoolConfig:
    """A :class:`PoolConfig`, given one or an object with a ``.config`` (a ``Pool``: only its
    configuration is read; the data plane never uses the control plane itself)."""
    config = getattr(source, "config", source)
    if not isinstance(config, PoolConfig):
        raise InvalidArgumentError(
            f"config: expected a PoolConfig (or a Pool), got {type(source).__name__}"
        )
    return config


def layout_for(config: PoolConfig, dataplane: DataPlaneConfig, num_instances: int) -> Layout:
    if config.device != dataplane.device:
        raise InvalidArgumentError(
            f"config.device: the pool is configured for {config.device!r}, the data plane runs "
            f"on {dataplane.device!r}"
        )
    return Layout(
        config.model, num_instances, config.num_slots, config.segment_len,
        dataplane.max_q_rows, dataplane.max_kv_rows,
    )  # fmt: skip


def host_tier(config: PoolConfig, device) -> HostTierStore | None:
    """The data plane's host tier for a pool with ``config.num_tier_blocks`` (``None``: 0)."""
    if not config.num_tier_blocks:
        return None
    return HostTierStore(config.model, config.num_tier_blocks, config.segment_len, device)


class ClusterBase:
    """``engine(i)`` hands out instance ``i``'s :class:`EngineClient`; :meth:`retire` tells
    every client that the control plane committed or aborted an epoch."""

    _driver: Driver
    _clients: list[EngineClient]

    @property
    def backend(self) -> str | None:
        """The kernel backend every engine uses (``None``: chosen by device)."""
        return self._driver.backend

    @property
    def logit_cap(self) -> float:
        """The pool's attention soft cap (``ModelShape.logit_cap``, 0: none): every partial
        applies it, and so must the local attention merged with them."""
        return self._driver.layout.model.logit_cap

    @property
    def num_instances(self) -> int:
        return len(self._clients)

    def engine(self, instance_id: int) -> EngineClient:
        check_int("instance_id", instance_id, low=0, high=len(self._clients))
        if instance_id in self._driver.lost:
            raise PeerFailedError(instance_id, "query", "instance was marked lost")
        return self._clients[instance_id]

    def retire(self, epoch: int) -> None:
        """The control plane committed or aborted ``epoch``: every client rejects its plans
        and buffers from now on (``StalePlanError``)."""
        check_int("epoch", epoch, low=0)
        for client in self._clients:
            client.retire(epoch)

    def synchronize(self) -> None:
        """Wait until every put in flight has landed."""
        for i, client in enumerate(self._clients):
            if i not in self._driver.lost:
                client.synchronize()

    def _make_clients(self, num_instances: int) -> None:
        self._driver.num_served = num_instances
        self._clients = [EngineClient(i, self._driver) for i in range(num_instances)]
