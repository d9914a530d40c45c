"""TokenLake's SGLang backend against SGLang's own ``torch_native`` backend on the same real
SGLang batches (fp32, max abs error ≤ 1e-5), over 1–4 pool instances and segment lengths 1–64."""

from __future__ import annotations

import pytest

sgl_world = pytest.importorskip("sgl_world", reason="sglang is not installed")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from tokenlake.engines.sglang.config import SGLangPoolConfig  # noqa: E402

TOL = sgl_world.TOLERANCE
tokens = sgl_world.tokens


def world(num_instances: int, segment_len: int, **kw) -> sgl_world.World:
    config = SGLangPoolConfig(num_instances=num_instances, num_slots=2048, segment_len=segment_len)
    return sgl_world.World(config, **kw)


@pytest.mark.parametrize(
    "num_instances,segment_len", [(1, 1), (2, 4), (3, 7), (4, 16), (2, 64), (4, 64)]
)
def test_serving_session_matches_torch_native(num_instances: int, segment_len: int) -> None:
    serving_session(world(num_instances, segment_len))


@pytest.mark.parametrize(
    "num_instances,segment_len,logit_cap", [(1, 1, 1.0), (2, 4, 0.5), (3, 7, 2.0), (4, 64, 1.0)]
)
def test_soft_capped_session_matches_plain_attention(
    num_instances: int, segment_len: int, logit_cap: float
) -> None:
    """``RadixAttention.logit_cap > 0`` (Gemma-2, Grok) against monolithic soft-capped
    attention; SGLang's torch_native, which ignores the cap, is far off."""
    w = world(num_instances, segment_len, reference="plain", logit_cap=logit_cap)
    assert w.tokenlake.runtime.cluster.logit_cap == logit_cap
    serving_session(w)
    assert w.native_err > 100 * TOL, w.native_err


def test_plain_reference_is_torch_native_without_a_cap() -> None:
    w = world(2, 4, reference="plain")
    serving_session(w)
    assert w.native_err <= TOL


def serving_session(w: sgl_world.World, tol: float = TOL) -> None:
    """Extend without and with a prefix, chunked prefill, decode and mixed batches, a radix
    hit inside another request's open segment (backfill), finish and the next turn; each
    forward within ``tol`` of the reference."""
    TOL = tol  # noqa: N806
    doc = tokens(1, 45)
    a = doc + tokens(2, 6)
    w.add("a", a + tokens(3, 8))
    w.add("b", tokens(4, 9))
    assert w.step({"a": len(a), "b": 9}) <= TOL  # extend, no prefix
    for _ in range(3):  # decode both
        assert w.step({"a": 1, "b": 1}) <= TOL
    # SGLang's radix cache hands "c" the first 45 tokens of the running "a"
    w.add("c", doc + tokens(5, 30), share_from="a", share=45)
    assert w.step({"c": 12}) <= TOL  # extend with prefix (first chunk of a chunked prefill)
    assert w.step({"c": 18}) <= TOL  # its last chunk
    # mixed: "c" decodes while "d" prefills
    w.add("d", tokens(6, 20))
    assert w.step({"c": 1, "d": 20}, mode=ForwardMode.MIXED) <= TOL
    assert w.step({"a": 1, "b": 1, "c": 1, "d": 1}) <= TOL
    # "a" finishes; its next turn hits all of it in SGLang's cache
    turn2 = w.reqs["a"].tokens[: w.reqs["a"].num_cached]
    w.add("a2", turn2 + tokens(7, 5), share_from="a", share=len(turn2))
    w.release("a")
    assert w.step({"a2": 5, "b": 1}) <= TOL
    assert w.max_err <= TOL


def test_gqa_and_custom_scaling_match() -> None:
    """8 query heads over 2 KV heads, a softmax scale that is not 1/sqrt(head_dim)."""
    w = world(2, 8, num_q_heads=8, num_kv_heads=2, head_dim=32, scaling=0.07, num_layers=3)
    w.add("x", tokens(10, 40))
    w.add("y", tokens(11, 17))
    assert w.step({"x": 40, "y": 17}) <= TOL
    w.add("z", w.reqs["x"].tokens[:33] + tokens(12, 4), share_from="x", share=33)
    assert w.step({"x": 1, "y": 1, "z": 4}, mode=ForwardMode.MIXED) <= TOL


def test_gqa_custom_scaling_and_soft_cap() -> None:
    w = world(2, 8, num_q_heads=8, num_kv_heads=2, head_dim=32, scaling=0.3, num_layers=3,
              logit_cap=0.8, reference="plain")  # fmt: skip
    w.add("x", tokens(10, 40))
    w.add("y", tokens(11, 17))
    assert w.step({"x": 40, "y": 17}) <= TOL
    w.add("z", w.reqs["x"].tokens[:33] + tokens(12, 4), share_from="x", share=33)
    assert w.step({"x": 1, "y": 1, "z": 4}, mode=ForwardMode.MIXED) <= TOL
    assert w.step({"x": 1, "y": 1, "z": 1}) <= TOL
    assert w.native_err > 100 * TOL


def test_pool_keeps_prefixes_sglang_released() -> None:
    """Finishing, aborting or retracting releases the pool's pins at the next forward; the
    prefix stays in the pool's tree, and a retracted request recomputed from scratch in a new
    row is a new pool request."""
    w = world(2, 4)
    prompt = tokens(20, 26)
    w.add("p", prompt + tokens(21, 3))
    w.add("q", tokens(22, 11))
    assert w.step({"p": 26, "q": 11}) <= TOL
    assert w.step({"p": 1, "q": 1}) <= TOL
    assert len(w.pool.requests) == 2
    w.release("p")  # finished
    w.release("q")  # retracted: SGLang frees its row and will recompute it
    w.add("q", tokens(22, 11) + [0])  # re-admitted in a new row
    assert w.step({"q": 12}) <= TOL  # no SGLang prefix: recomputed in full
    assert len(w.pool.requests) == 1  # "p" and the old "q" were finished
    w.pool.check_invariants()
    tree = w.pool.get_prefix_tree()
    assert tree.match(prompt).num_tokens == 26  # sealed segments and the partial tail of "p"
    ids = list(w.pool.requests)
    assert len(ids) == 1 and ids[0].startswith("q#")


def test_backfill_when_pool_lacks_sglang_prefix() -> None:
    """SGLang reuses a prefix the pool does not hold as sealed segments (it sits in another
    request's open segment): the gap's K/V come from SGLang's cache and are put into the pool."""
    w = world(1, 64)
    w.add("long", tokens(30, 50))
    assert w.step({"long": 50}) <= TOL
    w.add("share", w.reqs["long"].tokens[:40] + tokens(31, 6), share_from="long", share=40)
    assert w.step({"share": 6}) <= TOL
    m = w.tokenlake.forward_metadata
    assert m.num_backfill == 40
    assert w.pool.num_stored_tokens(w.tokenlake.requests.pool_id(w.reqs["share"].row)) == 46


@pytest.mark.parametrize(
    "num_slots,max_forward_rows,num_local",
    [(8, 16384, (1, 8)), (12, 16384, (1, 8)), (2048, 40, (9, 9)), (2048, 64, (0, 0))],
)
def test_pool_smaller_than_sglang_cache_stays_exact(
    num_slots: int, max_forward_rows: int, num_local: tuple[int, int]
) -> None:
    """A pool far smaller than SGLang's 2048-token cache (8 or 12 slots of 4 tokens per
    instance: some forwards pooled, some not), or staging buffers smaller than the session's
    first batch (60 rows): the forwards the pool cannot take are attended from SGLang's
    cache, the others are pooled, all 9 exact."""
    config = SGLangPoolConfig(num_instances=2, num_slots=num_slots, segment_len=4,
                              max_forward_rows=max_forward_rows)  # fmt: skip
    w = sgl_world.World(config)
    serving_session(w)
    low, high = num_local
    assert low <= w.tokenlake.num_local_forwards <= high
    w.pool.check_invariants()
