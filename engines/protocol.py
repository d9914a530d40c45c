"""The one engine protocol every compute engine codes against, whatever the transport
(in-process :class:`~tokenlake.engines.clusters.local.LocalCluster`, multi-process
:class:`~tokenlake.engines.clusters.mp.MPCluster`, or a compute process of its own). The
iteration driver that runs a model through it is :func:`tokenlake.engines.client.forward.run_forward`.

One layer of one iteration (docs/architecture.md#one-iterations-life)::

    q_buf = engine.init_query(query_plan)      # [rows, H_q, D]: the model writes q here
    kv_buf = engine.init_transfer(transfer_plan)  # [L, rows, 2, H_kv, D]: new K, V
    for layer in range(L):
        ...                                    # model writes q_buf, kv_buf[layer]
        engine.put(kv_buf, layer)
        o, lse = engine.query(q_buf, layer)    # f32 [rows, H_q, D], f32 [rows, H_q] (ln)
        ...                                    # merge with causal self-attention
    engine.synchronize()                       # every put landed: the iteration may commit

The control plane's side: ``retire(epoch)`` once it committed or aborted an epoch; the
transfer plans carry its segment copies (copy-on-extend and replication orders), executed
by ``init_transfer`` before any put. Eviction needs no data movement: a freed slot is
simply overwritten by its next put.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from tokenlake.plans import QueryPlan, TransferPlan


@runtime_checkable
class Engine(Protocol):
    """The data-plane API of one instance."""

    instance_id: int

    def init_query(self, query_plan: QueryPlan) -> torch.Tensor:
        """Bind a query plan; returns ``q_buf`` ``[num_rows, H_q, D]`` (model dtype)."""
        ...

    def query(self, q_buf: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix attention of ``q_buf``'s rows over the whole pool for ``layer``: ``o``
        ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32 (natural
        log, ``-inf`` for an empty prefix)."""
        ...

    def init_transfer(self, transfer_plan: TransferPlan) -> torch.Tensor:
        """Bind a transfer plan and run its segment copies; returns ``kv_buf``
        ``[num_layers, num_rows, 2, H_kv, D]`` (model dtype)."""
        ...

    def put(self, kv_buf: torch.Tensor, layer: int) -> None:
        """Store ``kv_buf[layer]`` where the plan says; ordered before the next read of it."""
        ...

    def synchronize(self) -> None:
        """Wait until every put of this instance has landed."""
        ...

    def retire(self, epoch: int) -> None:
        """The control plane committed or aborted ``epoch``; its plans are stale."""
        ...
