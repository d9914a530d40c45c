"""The iteration driver: runs one sub-batch of a planned iteration on an engine, layer by
layer, around a compute engine's :class:`~tokenlake.engines.protocol.LayerCompute` hook.
The synthetic engine (tests, demo, benchmarks) and the model engine both use it."""

from __future__ import annotations

from tokenlake.engines.protocol import Engine, LayerCompute
from tokenlake.plans import QueryPlan, TransferPlan


def run_sub_batch(
    engine: Engine, query_plan: QueryPlan, transfer_plan: TransferPlan, compute: LayerCompute
) -> None:
    """Bind both plans, then per layer: ``compute.write`` (q and new K/V) → ``put`` →
    ``query`` → ``compute.attend``; finally wait until every put landed, so the control
    plane may commit the iteration once every sub-batch returned."""
    q_buf = engine.init_query(query_plan)
    kv_buf = engine.init_transfer(transfer_plan)
    for layer in range(kv_buf.shape[0]):
        compute.write(layer, q_buf, kv_buf)
        engine.put(kv_buf, layer)
        o, lse = engine.query(q_buf, layer)
        compute.attend(layer, o, lse)
    engine.synchronize()
