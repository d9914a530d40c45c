"""One layer of the model engine's attention path as a GPU would run it (puts, the prefix
query and its merge, the local causal part): a fixed number of kernels whatever the batch,
and no host read of a tensor's value.

Counted with :class:`~tokenlake.engines.kernels.op_count.OpCounter` from the end of the
second layer's projections to its ``absorb`` (the dense layers are the model's own ragged
forward), one sub-batch (DoP 1). The in-process query engines of the other holders run on
this thread; their ``RunQuery`` work is counted apart too. docs/benchmarks.md names the
numbers held here.
"""

from __future__ import annotations

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.engines.client.forward import run_forward
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.kernels.op_count import OpCounter
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.transport import messages

VOCAB = 97
PROMPT_LEN = 40
LAYER = 1
# kernels of one layer's attention path on the origin, by (decode or extend, several holders)
ORIGIN_KERNELS = {
    ("decode", False): 10,
    ("extend", False): 24,
    ("decode", True): 39,
    ("extend", True): 53,
}
PER_REMOTE_HOLDER = 3  # its gather of q rows, its copies of o and lse (+ its attention call)


class _CountedModel:
    """The model, with a counter running from the end of ``project(LAYER)`` to ``absorb``."""

    def __init__(self, model, counters: dict) -> None:
        self.model, self.counters = model, counters
        self.num_layers = model.num_layers

    def begin(self, batch):
        return self.model.begin(batch)

    def project(self, state, layer):
        out = self.model.project(state, layer)
        if layer == LAYER:
            self.counters["peers"] = OpCounter()
            self.counters["layer"] = OpCounter().__enter__()
        return out

    def absorb(self, state, layer, o, lse):
        if layer == LAYER:
            self.counters["layer"].__exit__(None, None, None)
        return self.model.absorb(state, layer, o, lse)


def layer_counts(checkpoints, num_instances: int, batch_size: int, new_len: int):
    model = LlamaModel.from_dir(checkpoints.path("llama"))
    config = tl.PoolConfig(model.shape, num_instances, 4096, 4)
    pool = tl.Pool(config)
    cluster = LocalCluster(pool)
    counters: dict = {}
    for engine in cluster._engines.values():
        run = engine.handlers[messages.RunQuery]

        def run_counted(m, run=run):
            if "layer" in counters and "peers" in counters and m.layer == LAYER:
                with counters["peers"]:
                    return run(m)
            return run(m)

        engine.handlers[messages.RunQuery] = run_counted
    rng = np.random.default_rng(7)
    prompts = {
        f"r{i}": rng.integers(0, VOCAB, PROMPT_LEN).astype(np.int32) for i in range(batch_size)
    }
    first = [tl.Chunk(rid, p, 0, PROMPT_LEN - new_len) for rid, p in prompts.items()]
    plans = pool.gen_plans([first], [1])
    run_forward(cluster, plans, {c.request_id: c for c in first}, model)
    pool.commit(plans)
    cluster.retire(plans.epoch)
    second = [tl.Chunk(rid, p, PROMPT_LEN - new_len, PROMPT_LEN) for rid, p in prompts.items()]
    plans = pool.gen_plans([second], [1])
    (qp,) = plans.query_plans
    holders = {p.instance_id for p in qp.parts}
    run_forward(cluster, plans, {c.request_id: c for c in second}, _CountedModel(model, counters))
    pool.commit(plans)
    return counters["layer"], counters["peers"], holders, qp.origin


@pytest.mark.parametrize("new_len", [1, 5], ids=["decode", "extend"])
@pytest.mark.parametrize("num_instances", [1, 2, 4])
def test_attention_path_kernels_do_not_grow_with_the_batch(checkpoints, num_instances, new_len):
    """0 host reads per layer; the origin's kernels the same for 1, 8 and 64 requests and for
    2 to 4 holders; each other holder adds its own fixed few."""
    mode = "decode" if new_len == 1 else "extend"
    seen = {}
    for batch_size in (1, 8, 64):
        layer, peers, holders, origin_id = layer_counts(
            checkpoints, num_instances, batch_size, new_len
        )
        assert layer.num_host_reads == 0, layer.ops
        assert peers.num_host_reads == 0, peers.ops
        assert origin_id in holders
        origin = layer.num_kernels - peers.num_kernels
        seen[batch_size] = (origin, peers.num_kernels, sorted(holders))
        assert origin == ORIGIN_KERNELS[mode, len(holders) > 1], (seen, layer.kernels)
        assert peers.num_kernels == PER_REMOTE_HOLDER * (len(holders) - 1), peers.kernels
