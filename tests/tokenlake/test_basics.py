"""Segment keys, token validation, the slot allocator and config validation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenlake
from tokenlake.cluster.slots import SlotAllocator
from tokenlake.config import DEFAULT_SEGMENT_LEN, ModelShape, PoolConfig
from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher, as_tokens

TOKENS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


def arr(tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


# ---- SegmentHasher ------------------------------------------------------------------------
def reference_key(namespace: str, parent_key: int, tokens: list[int]) -> int:
    """docs/architecture.md#words: xxh64(parent key ‖ token ids), seeded by the namespace."""
    seed = xxhash.xxh64_intdigest(namespace.encode())
    data = parent_key.to_bytes(8, "little") + np.array(tokens, dtype="<i4").tobytes()
    return xxhash.xxh64_intdigest(data, seed=seed)


@settings(max_examples=150, deadline=None)
@given(tokens=TOKENS, parent=st.integers(0, 2**64 - 1))
def test_key_matches_reference_and_is_deterministic_across_instances(tokens, parent):
    a, b = SegmentHasher("model-a"), SegmentHasher("model-a")
    assert a.root_key == b.root_key
    assert a.key(parent, arr(tokens)) == b.key(parent, arr(tokens))
    assert a.key(parent, arr(tokens)) == reference_key("model-a", parent, tokens)


def test_key_is_the_same_in_processes_with_other_hash_seeds():
    tokens = [5, 17, 2**31 - 1, 0, 42, 42, 7, 1]
    code = (
        "import sys, types\n"
        # Load tokenlake.keys without the package __init__ (which imports torch: slow).
        "pkg = types.ModuleType('tokenlake'); pkg.__path__ = [sys.argv[1]]\n"
        "sys.modules['tokenlake'] = pkg\n"
        "import numpy as np\n"
        "from tokenlake.keys import SegmentHasher\n"
        "h = SegmentHasher('ns')\n"
        f"t = np.array({tokens}, dtype=np.int32)\n"
        "print(h.root_key, *h.chain(t, 4), h.key(h.root_key, t[:3]))\n"
    )
    h = SegmentHasher("ns")
    t = arr(tokens)
    expected = " ".join(map(str, [h.root_key, *h.chain(t, 4), h.key(h.root_key, t[:3])]))
    pkg_dir = str(Path(tokenlake.__file__).parent)
    for hash_seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code, pkg_dir],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout.split() == expected.split()


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
def test_namespace_changes_every_key(tokens):
    a, b = SegmentHasher("model-a"), SegmentHasher("model-b")
    assert a.root_key != b.root_key
    assert a.key(a.root_key, arr(tokens)) != b.key(b.root_key, arr(tokens))
    assert a.key(7, arr(tokens)) != b.key(7, arr(tokens))


@settings(max_examples=150, deadline=None)
@given(
    tokens=TOKENS,
    seg=st.integers(1, 7),
    parent=st.none() | st.integers(0, 2**64 - 1),
    bits=st.sampled_from([2, 17, 64]),
)
def test_chain_equals_iterated_key(tokens, seg, parent, bits):
    h = SegmentHasher("t", key_bits=bits)
    t = arr(tokens)
    key, expected = h.root_key if parent is None else parent, []
    for i in range(len(tokens) // seg):
        key = h.key(key, t[i * seg : (i + 1) * seg])
        expected.append(key)
    assert h.chain(t, seg, parent) == expected
    assert all(0 <= k < 2**bits for k in expected)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=20, unique=True))
def test_key_depends_on_token_order_and_parent(tokens):
    h = SegmentHasher("t")
    t = arr(tokens)
    assert h.key(h.root_key, t) != h.key(h.root_key, t[::-1].copy())
    assert h.key(h.root_key, t) != h.key(h.root_key ^ 1, t)
    # Same tokens split differently are different segments (lengths are part of the content).
    assert h.key(h.root_key, t) != h.key(h.key(h.root_key, t[:1]), t[1:])


def test_hasher_rejects_bad_key_bits():
    for bits in (0, 65):
        with pytest.raises(InvalidArgumentError, match="key_bits"):
            SegmentHasher("t", key_bits=bits)


# ---- as_tokens ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        [1, -1],
        [2**31],
        np.array([2**40], dtype=np.int64),
        np.array([-3], dtype=np.int64),
        ["a"],
        [None],
        [[1, 2], [3, 4]],
        np.zeros((2, 2), dtype=np.int32),
        [[1], [2, 3]],
        5,
    ],
    ids=repr,
)
def test_as_tokens_rejects_bad_input_naming_the_argument(bad):
    with pytest.raises(InvalidArgumentError, match="prompt_ids"):
        as_tokens(bad, name="prompt_ids")


def test_as_tokens_rejects_negative_int32_array():
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        as_tokens(np.array([4, -1], dtype=np.int32))


@pytest.mark.parametrize("bad", [[1.5, 2.0], np.array([0.5, 3.0]), ["7"]], ids=repr)
def test_as_tokens_rejects_non_integers(bad):
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        as_tokens(bad)


@settings(max_examples=150, deadline=None)
@given(tokens=TOKENS, kind=st.sampled_from(["list", "int64", "int32", "uint16"]))
def test_as_tokens_returns_read_only_int32(tokens, kind):
    source = {
        "list": lambda: list(tokens),
        "int64": lambda: np.array(tokens, dtype=np.int64),
        "int32": lambda: np.array(tokens, dtype=np.int32),
        "uint16": lambda: np.array([t % 2**16 for t in tokens], dtype=np.uint16),
    }[kind]()
    out = as_tokens(source)
    assert out.dtype == np.int32 and out.ndim == 1
    assert not out.flags.writeable
    assert out.tolist() == [int(t) for t in source]
    with pytest.raises(ValueError):
        out[:1] = 0
    if isinstance(source, np.ndarray):
        assert source.flags.writeable  # the caller's array is not frozen behind its back


# ---- SlotAllocator ------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(num_slots=st.integers(1, 12), ops=st.lists(st.integers(-1, 13), max_size=80))
def test_slot_allocator_against_set_model(num_slots, ops):
    """op -1 allocates; op s frees slot s (an error unless s is allocated)."""
    alloc, used = SlotAllocator(num_slots), set()
    for op in ops:
        if op < 0:
            slot = alloc.allocate()
            if len(used) == num_slots:
                assert slot is None
            else:
                assert slot is not None and 0 <= slot < num_slots and slot not in used
                used.add(slot)
        elif op in used:
            alloc.free(op)
            used.remove(op)
        else:
            with pytest.raises(InvalidArgumentError, match="slot"):
                alloc.free(op)
        alloc.check_invariants()
        assert alloc.num_used == len(used) and alloc.num_free == num_slots - len(used)
        assert [alloc.is_used(s) for s in range(num_slots)] == [s in used for s in range(num_slots)]


def test_slot_allocator_full_and_double_free():
    alloc = SlotAllocator(3)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    assert alloc.allocate() is None and alloc.num_free == 0
    alloc.free(1)
    with pytest.raises(InvalidArgumentError, match="slot"):
        alloc.free(1)
    assert alloc.allocate() == 1
    alloc.check_invariants()
    for bad in (0, -2):
        with pytest.raises(InvalidArgumentError, match="num_slots"):
            SlotAllocator(bad)


def test_slot_allocator_hands_out_lowest_free_id_first():
    alloc = SlotAllocator(4)
    for _ in range(3):
        alloc.allocate()
    alloc.free(0)
    alloc.free(1)
    assert alloc.allocate() == 0


# ---- config -------------------------------------------------------------------------------
SHAPE = {"num_layers": 3, "num_q_heads": 8, "num_kv_heads": 2, "head_dim": 16}


@pytest.mark.parametrize(("dtype", "nbytes"), [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_derived_byte_sizes(dtype, nbytes):
    shape = ModelShape(**SHAPE, dtype=dtype)
    assert shape.dtype_bytes == nbytes
    assert shape.kv_bytes_per_token_layer == 2 * 2 * 16 * nbytes  # K and V, 2 heads of 16
    assert shape.kv_bytes_per_token == 3 * 64 * nbytes
    assert shape.q_bytes_per_token_layer == 8 * 16 * nbytes
    device = "cuda" if dtype == "float16" else "cpu"  # the CPU kernels have no float16
    cfg = PoolConfig(shape, num_instances=4, num_slots=10, segment_len=32, device=device)
    assert cfg.segment_bytes == 32 * 3 * 64 * nbytes
    assert cfg.capacity_tokens == 4 * 10 * 32
    assert cfg.segment_len * shape.kv_bytes_per_token == cfg.segment_bytes


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_q_heads": -8}, "num_q_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": 16.0}, "head_dim"),
        ({"head_dim": True}, "head_dim"),
        ({"num_q_heads": 6, "num_kv_heads": 4}, "num_q_heads"),
        ({"num_q_heads": 2, "num_kv_heads": 8}, "num_q_heads"),
        ({"dtype": "fp8"}, "dtype"),
        ({"dtype": "int32"}, "dtype"),
    ],
)
def test_model_shape_validation_names_the_field(changes, field):
    with pytest.raises(InvalidArgumentError, match=rf"ModelShape\.{field}"):
        ModelShape(**{**SHAPE, **changes})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_instances": 0}, "num_instances"),
        ({"num_slots": 0}, "num_slots"),
        ({"num_slots": -1}, "num_slots"),
        ({"segment_len": 0}, "segment_len"),
        ({"segment_len": 512.0}, "segment_len"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": 3}, "namespace"),
        ({"model": SHAPE}, "model"),
    ],
)
def test_pool_config_validation_names_the_field(changes, field):
    good = {"model": ModelShape(**SHAPE), "num_instances": 2, "num_slots": 4}
    with pytest.raises(InvalidArgumentError, match=rf"PoolConfig\.{field}"):
        PoolConfig(**{**good, **changes})
    assert issubclass(InvalidArgumentError, ValueError)


def test_configs_are_frozen():
    shape = ModelShape(**SHAPE)
    cfg = PoolConfig(shape, num_instances=2, num_slots=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.head_dim = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 8
    assert cfg.segment_len == DEFAULT_SEGMENT_LEN == 64 and shape.dtype == "float32"


def test_one_segment_len_default_for_the_pool_the_server_and_sglang():
    from tokenlake.engines.sglang.config import SGLangPoolConfig
    from tokenlake.serve.config import ServeConfig

    defaults = {
        "pool": PoolConfig(ModelShape(**SHAPE), 1, 1).segment_len,
        "sglang": SGLangPoolConfig().segment_len,
        "serve": {f.name: f.default for f in dataclasses.fields(ServeConfig)}["segment_len"],
    }
    assert set(defaults.values()) == {DEFAULT_SEGMENT_LEN}, defaults
