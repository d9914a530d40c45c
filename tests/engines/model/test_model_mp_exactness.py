"""Token-exactness on the multi-process data plane (query and transfer engines as their own
processes, shared-memory pools): the same oracle as the in-process tests, fewer cases."""

from __future__ import annotations

import pytest
from driver import generate
from test_model_exactness import check, prompts_with_shared_prefix

import tokenlake as tl
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mp(checkpoints):
    model = LlamaModel.from_dir(checkpoints.path("llama"))
    largest = tl.Pool(tl.PoolConfig(model.shape, 4, 64, 64))
    config = DataPlaneConfig(max_q_rows=512, max_kv_rows=512, timeout_s=20.0)
    with MPCluster(largest, config, backend="cpu") as cluster:
        yield model, cluster


@pytest.mark.parametrize(
    "num_instances, segment_len, chunk_len, dop", [(1, 8, 13, 1), (2, 5, 9, 2), (4, 16, 21, 4)]
)
def test_mp_cluster_generation_is_exact(
    checkpoints, mp, num_instances, segment_len, chunk_len, dop
):
    model, cluster = mp
    pool = tl.Pool(tl.PoolConfig(model.shape, num_instances, 64, segment_len))
    engine = ModelEngine(model, cluster.reset(pool, "cpu"))
    prompts = prompts_with_shared_prefix(11, 33, [4, 12, 1])
    out = generate(pool, engine, prompts, 4, chunk_len=chunk_len, dop=dop, mixed=dop == 1)
    check(checkpoints, "llama", prompts, out, 4)
    again = {k + "-2": v + [1, 2, 3] for k, v in prompts.items()}
    out = generate(pool, engine, again, 3, chunk_len=chunk_len, dop=dop)
    check(checkpoints, "llama", again, out, 3)
    assert pool.get_stats()["num_hit_tokens"] > 0
