"""Random kernel calls for the fuzzer: valid cases, and hostile mutations of them.

A case is ``(kernel, kwargs)``; a hostile case also names the argument its error must name.
Every mutation makes the call invalid by the documented contract (docs/architecture.md#the-floors, the kernels'
docstrings), whatever the case it starts from; one that does not apply to a case returns None.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DTYPES = (torch.float32, torch.bfloat16)
I32 = torch.int32


@dataclass
class Case:
    kernel: str  # "partial_attention", "merge" or "self_attention"
    kwargs: dict
    bad_arg: str | None = None  # the argument a hostile case's error must name
    mutation: str = ""


def i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=I32)


def offsets(lens: list[int]) -> torch.Tensor:
    return i32([0, *np.cumsum(lens, dtype=np.int64).tolist()])


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (valid wherever a copy would be)."""
    return torch.stack([t, t], dim=-1)[..., 0] if t.numel() > 1 else t


def random_scale(rng: random.Random):
    return rng.choice([None, None, rng.uniform(0.05, 1.5), 1, np.float32(0.3)])


def random_cap(rng: random.Random):
    """A logit soft cap: mostly none (0), else small enough to bend the scores, or large."""
    return rng.choice([0.0, 0.0, 0, rng.uniform(0.2, 5.0), 30.0, np.float32(1.5), 1e-6, 1e6])


def paged_case(rng: random.Random, gen: torch.Generator) -> Case:
    batch = rng.choice([0, 1, 1, 2, 3, 5])
    page_len = rng.choice([1, 2, 5, 16])
    num_kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    head_dim, dtype = rng.choice([1, 4, 24, 64]), rng.choice(DTYPES)
    rows = [rng.choice([0, 1, 1, 2, 7]) for _ in range(batch)]
    pages = [rng.choice([0, 1, 2, 4]) for _ in range(batch)]
    num_slots = sum(pages) + rng.randint(1, 3)
    slots = rng.choices(range(num_slots), k=sum(pages))  # a slot may repeat
    # last_len is ignored where a request has no pages: any value is valid there
    last = [rng.randint(1, page_len) if p else rng.choice([0, -5, 99]) for p in pages]
    q = torch.randn(sum(rows), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    pool = torch.randn(num_slots, 2, page_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    kwargs = dict(
        q=strided(q) if rng.random() < 0.2 else q,
        q_indptr=offsets(rows),
        pool_layer=pool,
        kv_indptr=offsets(pages),
        kv_indices=i32(slots),
        last_len=i32(last),
        causal=rng.random() < 0.5,
        sm_scale=random_scale(rng),
        logit_cap=random_cap(rng),
    )
    if rng.random() < 0.2:
        kwargs["kv_indices"] = strided(kwargs["kv_indices"])
    return Case("partial_attention", kwargs)


def merge_case(rng: random.Random, gen: torch.Generator) -> Case:
    n, h, d = rng.choice([0, 1, 3, 6]), rng.choice([1, 4]), rng.choice([1, 8, 64])
    sides = []
    for _ in range(2):
        o = torch.randn(n, h, d, generator=gen)
        lse = 3 * torch.randn(n, h, generator=gen)
        empty = torch.rand(n, h, generator=gen) < rng.choice([0.0, 0.3, 1.0])
        lse[empty] = -math.inf
        o[empty] = 0.0  # what every kernel returns for a state that saw no keys
        sides.append((strided(o) if rng.random() < 0.2 else o, lse))
    (o_a, lse_a), (o_b, lse_b) = sides
    return Case("merge", dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b))


def self_case(rng: random.Random, gen: torch.Generator) -> Case:
    batch = rng.choice([0, 1, 2, 4])
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 3])
    head_dim, dtype = rng.choice([4, 32]), rng.choice(DTYPES)
    q_lens = [rng.choice([0, 1, 3, 6]) for _ in range(batch)]
    same = rng.random() < 0.4
    kv_lens = q_lens if same else [n + rng.choice([0, 2, 9]) for n in q_lens]
    if not same and rng.random() < 0.3:  # fewer keys than rows: early rows see nothing
        kv_lens = [max(0, n - 2) for n in q_lens]
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k, v = (
        torch.randn(sum(kv_lens), num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
    )
    kwargs = dict(q=q, k=k, v=v, indptr=offsets(q_lens), sm_scale=random_scale(rng))
    kwargs["logit_cap"] = random_cap(rng)
    kwargs["kv_indptr"] = None if same else offsets(kv_lens)
    return Case("self_attention", kwargs)


VALID = {"partial_attention": paged_case, "merge": merge_case, "self_attention": self_case}

# --- hostile mutations: (case kwargs, rng) -> (argument to name, new kwargs) or None ---------

Mutation = Callable[[dict, random.Random], "tuple[str, dict] | None"]

BAD_SCALES = [math.nan, math.inf, -math.inf, 0.0, -0.5, True, "0.1", torch.tensor(0.1),
              np.array(0.1), 1e-39, 1e39, complex(1, 0)]  # fmt: skip
BAD_BOOLS = [1, 0, None, "True", torch.tensor(True), 1.0, np.int8(1)]
# 0 means no cap; below 1e-6 or above 1e6 is out of range (tokenlake.config.LOGIT_CAP_RANGE)
BAD_CAPS = [math.nan, math.inf, -math.inf, -1.0, -1e-9, 1e-7, 1e7, True, False, None, "30",
            torch.tensor(30.0), np.array(30.0), complex(30, 0), np.nan]  # fmt: skip
BAD_INT_ARRAYS = [
    lambda t: t.long(),
    lambda t: t.float(),
    lambda t: t.bool(),
    lambda t: t.tolist(),
    lambda t: t.numpy(),
    lambda t: t.unsqueeze(0),
    lambda t: t.to("meta"),
    lambda t: t.to_sparse(),
]
BAD_FLOAT_TENSORS = [
    lambda t: t.double(),
    lambda t: t.half(),
    lambda t: t.int(),
    lambda t: t.select(-1, 0),
    lambda t: t.unsqueeze(0),
    lambda t: t.to("meta"),
    lambda t: t.to_sparse(),
    lambda t: t.numpy() if t.dtype == torch.float32 else t.tolist(),
]


def _set(kwargs: dict, **changes) -> dict:
    return {**kwargs, **changes}


def _bad_value(name: str, values: list) -> Mutation:
    return lambda kw, rng: (name, _set(kw, **{name: rng.choice(values)}))


def _bad_tensor(name: str, changes: list) -> Mutation:
    return lambda kw, rng: (name, _set(kw, **{name: rng.choice(changes)(kw[name])}))


def _poke(name: str, values: Callable[[dict], list], where: Callable[[dict], list]) -> Mutation:
    """Set one entry (chosen among ``where(kwargs)``) of an int32 array to a bad value."""

    def mutate(kw: dict, rng: random.Random):
        places = where(kw)
        if not places:
            return None
        t = kw[name].clone()
        t[rng.choice(places)] = rng.choice(values(kw))
        return name, _set(kw, **{name: t})

    return mutate


def _indptr_mutations(name: str, total: Callable[[dict], int]) -> list[Mutation]:
    """Offsets that do not start at 0, decrease, or do not end at ``total``."""
    size = lambda kw: kw[name].numel()  # noqa: E731
    return [
        _poke(name, lambda kw: [1, -1, 3], lambda kw: [0]),
        _poke(name, lambda kw: [total(kw) - 1, total(kw) + 1, 2**31 - 1], lambda kw: [-1]),
        _poke(name, lambda kw: [-7], lambda kw: list(range(1, size(kw)))),
        _bad_tensor(name, [lambda t: t.flip(0) + 1, lambda t: t[:0]]),  # from > 0; no entries
        _bad_tensor(name, BAD_INT_ARRAYS),
    ]


def _paged_has_pages(kw: dict) -> list[int]:
    pages = (kw["kv_indptr"][1:] - kw["kv_indptr"][:-1]).tolist()
    return [b for b, n in enumerate(pages) if n > 0]


def _extra_row(kw: dict, rng: random.Random):
    q = kw["q"]
    return "q_indptr", _set(kw, q=torch.cat([q, q.new_zeros((1, *q.shape[1:]))]))


def _extra_index(kw: dict, rng: random.Random):
    return "kv_indptr", _set(kw, kv_indices=torch.cat([kw["kv_indices"], i32([0])]))


def _uneven_heads(kw: dict, rng: random.Random):
    q = kw["q"]
    num_kv_heads = kw["pool_layer"].shape[3]
    heads = 0 if num_kv_heads == 1 else q.shape[1] + 1
    return "q", _set(kw, q=q.new_zeros((q.shape[0], heads, q.shape[2])))


PAGED_MUTATIONS: list[Mutation] = [
    _bad_tensor("q", BAD_FLOAT_TENSORS),
    _bad_tensor("q", [lambda t: t[..., :-1] if t.shape[2] > 1 else torch.cat([t, t], -1)]),
    _uneven_heads,
    _bad_tensor("q", [lambda t: t.float() if t.dtype == torch.bfloat16 else t.bfloat16()]),
    _bad_tensor("pool_layer", BAD_FLOAT_TENSORS),
    _bad_tensor(
        "pool_layer",
        [
            lambda t: t[:, :1],
            lambda t: t[:, :, :0],
            lambda t: t[:, :, :, :0],
            lambda t: torch.cat([t, t], dim=4)[..., : t.shape[4]],  # same shape, not contiguous
        ],
    ),
    *_indptr_mutations("q_indptr", lambda kw: kw["q"].shape[0]),
    _extra_row,
    *_indptr_mutations("kv_indptr", lambda kw: kw["kv_indices"].numel()),
    _extra_index,
    _bad_tensor("kv_indptr", [lambda t: t[:-1], lambda t: torch.cat([t, t[-1:]])]),
    _poke(
        "kv_indices",
        lambda kw: [kw["pool_layer"].shape[0], -1, -(2**31), 2**31 - 1],
        lambda kw: list(range(kw["kv_indices"].numel())),
    ),
    _bad_tensor("kv_indices", BAD_INT_ARRAYS),
    _poke("last_len", lambda kw: [0, -1, kw["pool_layer"].shape[2] + 1], _paged_has_pages),
    _bad_tensor("last_len", [*BAD_INT_ARRAYS, lambda t: torch.cat([t, i32([1])])]),
    _bad_value("sm_scale", BAD_SCALES),
    _bad_value("logit_cap", BAD_CAPS),
    _bad_value("causal", BAD_BOOLS),
    _bad_value("backend", ["gpu", "CPU", 1, ["cpu"], "flashinfer"]),
]


def _first_state(kw: dict) -> list[tuple[int, int]]:
    return [(0, 0)] if kw["o_a"].shape[0] else []


MERGE_MUTATIONS: list[Mutation] = [
    *(_bad_tensor(name, BAD_FLOAT_TENSORS) for name in ("o_a", "lse_a", "o_b", "lse_b")),
    _bad_tensor("o_b", [lambda t: torch.cat([t, t], dim=2), lambda t: t[:, :0]]),
    _bad_tensor("lse_a", [lambda t: torch.cat([t, t], dim=0) if t.numel() else t[:, :0]]),
    *(_poke(name, lambda kw: [math.nan, math.inf], _first_state) for name in ("lse_a", "lse_b")),
    _bad_value("backend", ["gpu", 0, "flashinfer"]),
]


def _given_kv_indptr(change: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    """A bad ``kv_indptr`` where one is given (without one, keys pair with ``indptr``)."""

    def mutate(kw: dict, rng: random.Random):
        if kw["kv_indptr"] is None:
            return None
        return "kv_indptr", _set(kw, kv_indptr=change(kw["kv_indptr"]))

    return mutate


def _unpaired_keys(kw: dict, rng: random.Random):
    if kw["kv_indptr"] is not None or kw["k"].shape[0] == 0:
        return None
    return "k", _set(kw, k=kw["k"][:-1], v=kw["v"][:-1])


SELF_MUTATIONS: list[Mutation] = [
    _bad_tensor("q", BAD_FLOAT_TENSORS),
    _bad_tensor("k", [*BAD_FLOAT_TENSORS, lambda t: t[..., :-1]]),
    _bad_tensor("v", [*BAD_FLOAT_TENSORS, lambda t: torch.cat([t, t], dim=1)]),
    *_indptr_mutations("indptr", lambda kw: kw["q"].shape[0]),
    _unpaired_keys,
    _given_kv_indptr(lambda t: t[:-1]),
    _given_kv_indptr(lambda t: t.long()),
    _given_kv_indptr(lambda t: torch.cat([t[:-1], t[-1:] + 1])),  # beyond the keys
    _bad_value("sm_scale", BAD_SCALES),
    _bad_value("logit_cap", BAD_CAPS),
]

MUTATIONS = {
    "partial_attention": PAGED_MUTATIONS,
    "merge": MERGE_MUTATIONS,
    "self_attention": SELF_MUTATIONS,
}


def hostile_case(kernel: str, index: int, rng: random.Random, gen: torch.Generator) -> Case:
    """A random valid case of ``kernel`` with mutation ``index`` applied (the first of some
    random cases it applies to)."""
    mutation = MUTATIONS[kernel][index]
    for _ in range(1000):
        mutated = mutation(VALID[kernel](rng, gen).kwargs, rng)
        if mutated is not None:
            name, kwargs = mutated
            return Case(kernel, kwargs, bad_arg=name, mutation=f"{kernel}#{index}")
    raise AssertionError(f"mutation {kernel}#{index} applies to no case")
