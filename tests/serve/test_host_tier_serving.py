"""``tokenlake serve --host-tier-gb``: a real tiny-random server whose pool is smaller than
the working set. The same requests go to a server without the tier and to one with it: with
the tier, a prompt evicted from the pool comes back from host memory (a hit, counted by tier
on ``/metrics``) instead of being recomputed, and every completion is the same token for
token. Flags the tier cannot run with are refused by name."""

from __future__ import annotations

import httpx
import pytest
from test_runtime_http import metric

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api.http_server import HTTPServer
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig

SMALL = dict(
    num_instances=2, segment_len=8, num_slots=12, chunk_len=32, max_num_seqs=4,
    max_model_len=160, profile=False, torch_threads=1, port=0,
)  # fmt: skip
# three prompts of 96 tokens: two fill the pool (2 x 12 slots of 8 tokens), a third evicts
PROMPTS = [[(31 * p + 7 * i) % 200 + 3 for i in range(96)] for p in range(3)]
ORDER = [0, 1, 2, 0, 1, 2, 0]


def serve_all(host_tier_gb: float) -> tuple[list[list[int]], dict]:
    config = ServeConfig(**SMALL, host_tier_gb=host_tier_gb)
    with (
        HTTPServer(build(config), "127.0.0.1", 0).start() as srv,
        httpx.Client(base_url=srv.url, timeout=120) as client,
    ):
        outputs = []
        for p in ORDER:
            r = client.post("/v1/completions", json={
                "model": "tiny-random", "prompt": PROMPTS[p], "max_tokens": 4,
                "temperature": 0,
            })  # fmt: skip
            assert r.status_code == 200, r.text
            outputs.append(r.json()["choices"][0]["text"])
        metrics = {
            "host hits": metric(client, "tokenlake:tier_hit_tokens_total", tier="host"),
            "pool hits": metric(client, "tokenlake:tier_hit_tokens_total", tier="pool"),
            "hits": metric(client, "tokenlake:pool_hit_tokens_total"),
            "prompt": metric(client, "tokenlake:pool_prompt_tokens_total"),
            "promotions": metric(client, "tokenlake:tier_promotions_total"),
            "demotions": metric(client, "tokenlake:tier_demotions_total"),
            "blocks": metric(client, "tokenlake:tier_blocks"),
        }
    return outputs, metrics


def test_the_tier_turns_recomputes_into_hits_with_the_same_completions():
    plain, plain_metrics = serve_all(0.0)
    tiered, tier_metrics = serve_all(0.01)
    assert tiered == plain  # greedy completions token for token
    assert plain_metrics["host hits"] == plain_metrics["blocks"] == 0
    assert tier_metrics["host hits"] > 0 and tier_metrics["blocks"] > 0
    assert tier_metrics["promotions"] > 0 and tier_metrics["demotions"] > 0
    assert tier_metrics["host hits"] + tier_metrics["pool hits"] == tier_metrics["hits"]
    assert tier_metrics["prompt"] == plain_metrics["prompt"]
    assert tier_metrics["hits"] > plain_metrics["hits"], (plain_metrics, tier_metrics)


@pytest.mark.parametrize(
    "fields",
    [
        dict(host_tier_gb=-1.0),
        dict(host_tier_gb="1"),
        dict(host_tier_gb=True),
        dict(host_tier_gb=1.0, data_plane="compute"),
    ],  # fmt: skip
)
def test_bad_tier_settings_are_refused_by_name(fields):
    with pytest.raises(InvalidArgumentError, match="host_tier_gb"):
        ServeConfig(**{**SMALL, **fields})
