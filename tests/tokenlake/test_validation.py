"""Bad input to the public API and configs: exact types, ranges and NaN are checked first,
the error names the argument, its value and what was allowed, and nothing changes.

Each case that issue 16 reproduced has a test here: ``drop_instance(1.0)`` / ``np.float64`` /
``0.0`` dropping replicas before raising and ``drop_instance(True)`` being accepted, a
``Chunk`` with ``end=2.5`` leaving a ghost request, ``PoolFullError`` advancing the LRU
clock, configs accepting ``2**63``, and errors that did not name the argument.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from harness import Harness, tokens
from pool_state import assert_same_state, pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import InvalidArgumentError, PoolFullError, UnknownRequestError

NOT_INTS = [1.0, 0.0, np.float64(1.0), True, False, np.bool_(True), "1", None, torch.tensor(1)]
SHAPE = {"num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}


_BUSY: list[Harness] = []


def busy_harness() -> Harness:
    """A fresh copy of :func:`build_busy_harness` (built once: rejected calls are cheap)."""
    if not _BUSY:
        _BUSY.append(build_busy_harness())
    return copy.deepcopy(_BUSY[0])


def build_busy_harness() -> Harness:
    """Two instances with replicas of a hot document, finished requests' tails and running
    requests (string ids and the int ids 0 and 1)."""
    h = Harness(2, 16, num_slots=24, balancer=BalancerConfig(interval=1, overload_factor=1.0))
    doc = tokens(1, 16 * 4)
    for i in range(5):
        batch = []
        for j in range(3):
            ids = np.concatenate([doc, tokens(10 + 3 * i + j, 5)])
            batch.append(tl.Chunk(f"r{i}.{j}", ids, h.cached(ids)))
        h.step([batch])
        for j in range(3):
            if (i + j) % 2:
                h.pool.finish(f"r{i}.{j}")
    h.step([[tl.Chunk(0, tokens(90, 7), 0)], [tl.Chunk(1, tokens(91, 9), 0)]])
    stats = h.pool.get_stats()
    assert stats["num_replicas"] > stats["num_segments"] and stats["num_running_requests"] > 2
    return h


def assert_rejected(h: Harness, call, *fragments: str, error=InvalidArgumentError) -> None:
    before = pool_state(h.pool)
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_same_state(before, pool_state(h.pool))
    h.pool.check_invariants()


# ---- configs ------------------------------------------------------------------------------
HUGE = [2**63, 2**64, 10**30]


@pytest.mark.parametrize("field", ["num_layers", "num_q_heads", "num_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", NOT_INTS + HUGE + [0, -1, math.nan])
def test_model_shape_rejects_non_ints_and_huge_values(field, value):
    changes = {field: value}
    with pytest.raises(InvalidArgumentError) as info:
        tl.ModelShape(**{**SHAPE, **changes})
    assert f"ModelShape.{field}: expected an int in [1, " in str(info.value)
    assert "got" in str(info.value)


@pytest.mark.parametrize("field", ["num_instances", "num_slots", "segment_len"])
@pytest.mark.parametrize("value", NOT_INTS + HUGE + [0, -3])
def test_pool_config_rejects_non_ints_and_huge_values(field, value):
    good = {"model": tl.ModelShape(**SHAPE), "num_instances": 2, "num_slots": 4}
    with pytest.raises(InvalidArgumentError, match=rf"PoolConfig\.{field}: expected an int in"):
        tl.PoolConfig(**{**good, field: value})


def test_pool_config_accepts_numpy_ints_as_python_ints():
    cfg = tl.PoolConfig(tl.ModelShape(**SHAPE), np.int64(2), np.int32(4), np.int16(16))
    assert type(cfg.num_instances) is int and type(cfg.num_slots) is int
    assert (cfg.num_instances, cfg.num_slots, cfg.segment_len) == (2, 4, 16)


def test_pool_config_rejects_segments_too_large_to_address():
    big = tl.ModelShape(2**10, 2**10, 2**10, 2**10)
    with pytest.raises(InvalidArgumentError, match=r"PoolConfig\.segment_len: .* bytes"):
        tl.PoolConfig(big, 2, 4, 2**10)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window", 1.5),
        ("window", True),
        ("window", 2**63),
        ("decay", math.nan),
        ("decay", 0.0),
        ("decay", 1.5),
        ("decay", math.inf),
        ("decay", True),
        ("overload_factor", math.nan),
        ("overload_factor", 0.5),
        ("heavy_hitter_k", -1.0),
        ("heavy_hitter_k", math.inf),
        ("max_replications", -1),
        ("max_replications", 3.0),
        ("interval", 0),
        ("interval", np.float64(4)),
        ("replicate", 1),
        ("replicate", "yes"),
        ("max_replica_fraction", math.nan),
        ("max_replica_fraction", 1.5),
        ("recent_decay", 1.0),
        ("recent_decay", torch.tensor(0.5)),
    ],
)
def test_balancer_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(InvalidArgumentError) as info:
        BalancerConfig(**{field: value})
    text = str(info.value)
    assert text.startswith(f"BalancerConfig.{field}: expected "), text
    assert "got" in text


def test_segment_hasher_and_pool_constructor_check_their_arguments():
    with pytest.raises(InvalidArgumentError, match="key_bits: expected an int in"):
        tl.SegmentHasher("ns", key_bits=64.0)
    with pytest.raises(InvalidArgumentError, match="namespace"):
        tl.SegmentHasher(b"ns")
    cfg = tl.PoolConfig(tl.ModelShape(**SHAPE), 2, 4, 16)
    for kwargs, name in [
        ({"config": "cfg"}, "config"),
        ({"config": cfg, "hasher": "h"}, "hasher"),
        ({"config": cfg, "balancer": {}}, "balancer"),
        ({"config": cfg, "seed": 1.5}, "seed"),
        ({"config": cfg, "seed": -1}, "seed"),
        ({"config": cfg, "load_model": 3}, "load_model"),
    ]:
        with pytest.raises(InvalidArgumentError, match=f"^{name}: expected"):
            tl.Pool(**kwargs)


# ---- Chunk --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("g", [1, 2, 3], 0, 2.5), "Chunk.end"),
        (("g", [1, 2, 3], 0, True), "Chunk.end"),
        (("g", [1, 2, 3], 0, 0), "Chunk.end"),
        (("g", [1, 2, 3], 0, 4), "Chunk.end"),
        (("g", [1, 2, 3], 1.0), "Chunk.start"),
        (("g", [1, 2, 3], np.float64(0)), "Chunk.start"),
        (("g", [1, 2, 3], -1), "Chunk.start"),
        (("g", [1, 2, 3], 3), "Chunk.start"),
        (("g", [1, 2, 3], torch.tensor(0)), "Chunk.start"),
        (("g", [1, 2, 3], None), "Chunk.start"),
        ((True, [1, 2], 0), "Chunk.request_id"),
        ((1.0, [1, 2], 0), "Chunk.request_id"),
        ((np.int64(3), [1, 2], 0), "Chunk.request_id"),
        ((2**63, [1, 2], 0), "Chunk.request_id"),
        (("", [1, 2], 0), "Chunk.request_id"),
        ((("a",), [1, 2], 0), "Chunk.request_id"),
        (("g", [1.5, 2], 0), "Chunk.token_ids"),
        (("g", [True, 2], 0), "Chunk.token_ids"),
        (("g", [-1, 2], 0), "Chunk.token_ids"),
        (("g", [2**31, 2], 0), "Chunk.token_ids"),
        (("g", [[1, 2]], 0), "Chunk.token_ids"),
        (("g", "abc", 0), "Chunk.token_ids"),
        (("g", torch.tensor([1, 2]), 0), "Chunk.token_ids"),
        (("g", np.array([1.0, 2.0]), 0), "Chunk.token_ids"),
        (("g", [], 0), "Chunk.token_ids"),
    ],
)
def test_chunk_rejects_bad_fields_when_built(args, name):
    with pytest.raises(InvalidArgumentError) as info:
        tl.Chunk(*args)
    assert str(info.value).startswith(f"{name}: expected"), str(info.value)


def test_chunk_with_float_end_leaves_no_ghost_request():
    h = busy_harness()
    before = pool_state(h.pool)
    with pytest.raises(InvalidArgumentError, match="Chunk.end"):
        h.pool.gen_plans([[tl.Chunk("g", tokens(3, 8), 0, 2.5)]])
    assert_same_state(before, pool_state(h.pool))
    with pytest.raises(UnknownRequestError):
        h.pool.finish("g")


# ---- pool calls ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", NOT_INTS + [np.float64(0.0), -1, 2, 2**63, math.nan, [1]])
def test_drop_instance_rejects_non_ints_before_touching_anything(value):
    h = busy_harness()
    assert_rejected(h, lambda: h.pool.drop_instance(value), "instance_id: expected", "got")
    assert h.pool.live_instances == (0, 1)


@pytest.mark.parametrize("value", NOT_INTS + [0, 1, 7])
def test_restore_instance_rejects_bad_ids(value):
    h = busy_harness()
    assert_rejected(h, lambda: h.pool.restore_instance(value), "instance_id: expected")


def test_drop_of_the_last_live_instance_is_refused():
    h = Harness(1, 16, num_slots=8)
    h.step([[tl.Chunk("a", tokens(1, 20), 0)]])
    assert_rejected(h, lambda: h.pool.drop_instance(0), "instance_id", "last live instance")


@pytest.mark.parametrize("value", [1.0, 0.0, True, False, np.int64(0), None, ["r0.0"], b"r0.0"])
def test_request_id_calls_reject_wrong_types(value):
    """Requests 0 and 1 are running: ``0.0``/``False``/``np.int64(0)`` must not alias them."""
    h = busy_harness()
    for call in (h.pool.finish, h.pool.num_stored_tokens, h.pool.in_flight_epoch):
        assert_rejected(h, lambda call=call: call(value), "request_id: expected")


def test_unknown_request_is_its_own_error():
    h = busy_harness()
    assert_rejected(h, lambda: h.pool.finish("nobody"), "nobody", error=UnknownRequestError)


@pytest.mark.parametrize(
    ("make", "fragments"),
    [
        (lambda c: ([c], [1.5]), ["dops[0]: expected an int in", "1.5"]),
        (lambda c: ([c], [True]), ["dops[0]", "True"]),
        (lambda c: ([c], [math.nan]), ["dops[0]", "nan"]),
        (lambda c: ([c], [np.float64(1)]), ["dops[0]"]),
        (lambda c: ([c], 1), ["dops: expected a list"]),
        (lambda c: ([c], [1, 1]), ["dops: expected 1 entries, got 2"]),
        (lambda c: ([c], [3]), ["dops[0]: expected an int in [1, 3)", "got 3"]),
        (lambda c: ([c, c], None), ["twice"]),
        (lambda c: (c, None), ["batches[0]: expected a list", "Chunk"]),
        (lambda c: (np.array(c), None), ["batches: expected a list"]),
        (lambda c: ([[c[0], "x"]], None), ["batches[0][1]: expected a Chunk", "'x'"]),
        (lambda c: ([()], None), ["batches[0]: expected at least 1 entries"]),
        (lambda c: ((c for c in [c]), None), ["batches: expected a list"]),
    ],
)
def test_gen_plans_rejects_bad_batches_and_dops(make, fragments):
    h = busy_harness()
    chunk = [tl.Chunk("new", tokens(7, 40), 0)]
    batches, dops = make(chunk)
    assert_rejected(h, lambda: h.pool.gen_plans(batches, dops), *fragments)


@pytest.mark.parametrize(
    ("instances", "fragments"),
    [
        ([[True]], ["instances[0][0]: expected a live instance id", "True"]),
        ([[1.0]], ["instances[0][0]", "1.0"]),
        ([[5]], ["instances[0][0]", "5"]),
        ([[0, 0]], ["instances[0]: expected distinct"]),
        ([[]], ["instances[0]: expected at least 1 entries"]),
        ([0], ["instances[0]: expected a list"]),
        ([[0], [1]], ["instances: expected 1 entries, got 2"]),
        ("0", ["instances: expected a list"]),
    ],
)
def test_gen_plans_rejects_bad_instances(instances, fragments):
    h = busy_harness()
    batches = [[tl.Chunk("new", tokens(7, 40), 0)]]
    assert_rejected(h, lambda: h.pool.gen_plans(batches, None, None, instances), *fragments)


def test_get_cache_load_checks_every_pair():
    h = busy_harness()
    for reqs, name in [
        ([(1.5, 2)], "reqs[0][0]"),
        ([(1, True)], "reqs[0][1]"),
        ([(1, -2)], "reqs[0][1]"),
        ([(1,)], "reqs[0]: expected 2 entries"),
        ("ab", "reqs: expected a list"),
    ]:
        assert_rejected(h, lambda reqs=reqs: h.pool.get_cache_load(reqs), name)


def test_pool_full_error_changes_nothing_not_even_the_lru_clock():
    """A pool full of pinned running requests: the refused call touches no LRU entry,
    counter or load window."""
    h = Harness(2, 16, num_slots=3)
    h.step([[tl.Chunk("a", tokens(1, 16 * 5 + 1), 0)]])
    shared = h.pool.tree.match(tokens(1, 16 * 5)).num_tokens
    assert shared == 80
    ids = np.concatenate([tokens(1, 16 * 5), tokens(2, 40)])
    for _ in range(3):
        assert_rejected(
            h, lambda: h.pool.gen_plans([[tl.Chunk("b", ids, 80)]]), error=PoolFullError
        )
