"""In-process data plane: N instances in one process, each with its own KV pool.

The fast test double of the multi-process engines: same plans, same executor code, same
kernels; "sending" a tensor to a peer is indexing that peer's pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenlake.engines import executor
from tokenlake.engines.kv_pool import KVPool
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import QueryPlan, TransferPlan
from tokenlake.pool import Pool
from tokenlake.validate import check_int, check_tensor


@dataclass(eq=False)
class _BoundQuery:
    plan: QueryPlan
    parts: list[executor.PreparedPart]
    buf: torch.Tensor


@dataclass(eq=False)
class _BoundTransfer:
    plan: TransferPlan
    puts: list[executor.PreparedPut]
    buf: torch.Tensor


class LocalEngine:
    """The data-plane API of one instance: ``init_query``/``query``/``init_transfer``/``put``."""

    def __init__(
        self,
        instance_id: int,
        kv_pools: list[KVPool],
        active_epoch: Callable[[], int | None],
        backend: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self._pools = kv_pools
        self._active_epoch = active_epoch
        self._backend = backend
        self._queries: dict[int, _BoundQuery] = {}
        self._transfers: dict[int, _BoundTransfer] = {}

    @property
    def _model(self):
        return self._pools[self.instance_id].model

    @property
    def _device(self) -> torch.device:
        return self._pools[self.instance_id].data.device

    def _check_plan(self, name: str, plan, kind: type) -> None:
        executor.check_plan(name, plan, kind, self.instance_id, self._active_epoch())

    def init_query(self, query_plan: QueryPlan) -> torch.Tensor:
        """Bind a query plan; returns ``q_buf`` ``[num_rows, H_q, D]`` (model dtype) for the
        compute engine to write q into, once per layer."""
        self._check_plan("query_plan", query_plan, QueryPlan)
        m = self._model
        buf = torch.zeros(
            (query_plan.num_rows, m.num_q_heads, m.head_dim),
            dtype=m.torch_dtype,
            device=self._device,
        )
        parts = executor.prepare_query(query_plan, self._device)
        self._queries = {k: v for k, v in self._queries.items() if v.plan.epoch == query_plan.epoch}
        self._queries[buf.data_ptr()] = _BoundQuery(query_plan, parts, buf)
        return buf

    def query(self, q_buf: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix attention of ``q_buf``'s rows over the whole pool for ``layer``.

        Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32
        (natural log; ``-inf`` for rows with an empty prefix).
        """
        bound = self._bound(self._queries, "q_buf", q_buf, "init_query")
        layer = check_int("layer", layer, low=0, high=self._model.num_layers)
        self._check_plan("q_buf", bound.plan, QueryPlan)
        n, h, d = bound.buf.shape
        o = torch.zeros((n, h, d), dtype=torch.float32, device=self._device)
        lse = torch.full((n, h), -math.inf, dtype=torch.float32, device=self._device)
        for part in bound.parts:
            pool_layer = self._pools[part.instance_id].layer(layer)
            o_p, lse_p = executor.holder_attention(pool_layer, part, bound.buf, self._backend)
            executor.merge_rows(o, lse, part.rows, o_p, lse_p, self._backend)
        return o, lse

    def init_transfer(self, transfer_plan: TransferPlan) -> torch.Tensor:
        """Bind a transfer plan and run its segment copies; returns ``kv_buf``
        ``[num_layers, num_rows, 2, H_kv, D]`` for the compute engine's new K and V."""
        self._check_plan("transfer_plan", transfer_plan, TransferPlan)
        m = self._model
        buf = torch.zeros(
            (m.num_layers, transfer_plan.num_rows, 2, m.num_kv_heads, m.head_dim),
            dtype=m.torch_dtype,
            device=self._device,
        )
        puts = executor.prepare_put(
            transfer_plan, self._pools[self.instance_id].data.shape[3], self._device
        )
        executor.copy_segments(self._pools, transfer_plan)
        self._transfers = {
            k: v for k, v in self._transfers.items() if v.plan.epoch == transfer_plan.epoch
        }
        self._transfers[buf.data_ptr()] = _BoundTransfer(transfer_plan, puts, buf)
        return buf

    def put(self, kv_buf: torch.Tensor, layer: int) -> None:
        """Store ``kv_buf[layer]`` into the planned slots (synchronous here; the multi-process
        engine returns early and orders it before the next read of that layer)."""
        bound = self._bound(self._transfers, "kv_buf", kv_buf, "init_transfer")
        layer = check_int("layer", layer, low=0, high=self._model.num_layers)
        self._check_plan("kv_buf", bound.plan, TransferPlan)
        for put in bound.puts:
            executor.write_rows(self._pools[put.instance_id], put, bound.buf[layer], layer)

    def _bound(self, table: dict, name: str, buf: object, init: str):
        check_tensor(name, buf)
        bound = table.get(buf.data_ptr())
        if bound is None:
            raise InvalidArgumentError(f"{name}: not a buffer returned by this engine's {init}()")
        check_tensor(
            name, buf, shape=tuple(bound.buf.shape), dtype=bound.buf.dtype, device=self._device
        )
        return bound


class LocalCluster:
    """``pool.config.num_instances`` in-process instances sharing one control plane."""

    def __init__(
        self, pool: Pool, device: torch.device | str = "cpu", backend: str | None = None
    ) -> None:
        cfg = pool.config
        self.pool = pool
        self.backend = backend
        self.kv_pools = [
            KVPool(cfg.model, cfg.num_slots, cfg.segment_len, device)
            for _ in range(cfg.num_instances)
        ]
        self.engines = [
            LocalEngine(i, self.kv_pools, lambda: pool.active_epoch, backend)
            for i in range(cfg.num_instances)
        ]

    def engine(self, instance_id: int) -> LocalEngine:
        check_int("instance_id", instance_id, low=0, high=len(self.engines))
        return self.engines[instance_id]
