"""A real multi-node Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``): a head and two
more nodes, each with a custom resource (``node0``, ``node1``, ``node2``) so that where an
instance lands is observable. Started once per test module, in its own temporary directory,
and shut down by process (never ``ray stop``)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import pytest

# Ray maps "127.0.0.1" to the machine's outward address when it connects; with clusters
# "disabled" for this process it keeps loopback (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ray = pytest.importorskip("ray")

NODE_CPUS = 2


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="tlray")  # short: Ray's socket paths must fit
    common = {
        "node_ip_address": "127.0.0.1",
        "num_cpus": NODE_CPUS,
        "object_store_memory": 100 << 20,
    }
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **common, "resources": {"node0": 8}, "include_dashboard": False, "temp_dir": temp_dir,
        },
    )  # fmt: skip
    try:
        for k in (1, 2):
            cluster.add_node(**common, resources={f"node{k}": 8})
        ray.init(
            address=cluster.address,
            namespace="tokenlake-tests",
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def node_of(resource: str) -> str:
    """The id of the node that has custom resource ``resource``."""
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Greedy generation by ``transformers`` of the seeded ``tiny-random`` model every launch
    here serves (``ServeConfig``'s default seed): ``generate(prompt_ids, n) -> n token ids``."""
    import torch
    import transformers

    from tokenlake.engines.model.tiny import write_tiny_random
    from tokenlake.serve.config import ServeConfig

    path = write_tiny_random(tmp_path_factory.mktemp("tiny"), seed=ServeConfig().seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()

    def generate(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, min_new_tokens=n)  # fmt: skip
        return out[0, len(ids) :].tolist()

    return generate
