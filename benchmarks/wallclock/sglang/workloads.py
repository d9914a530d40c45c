"""The SGLang wall-clock bench's request lists (arrival offsets at 1 req/s; the runner divides
them by the rate), token ids below ``vocab_size`` (the client turns each into one character):

- ``conversation``: the demo's conversation trace slice (:mod:`.workloads`).
- ``hot-document``: ``num_docs`` documents with Zipf popularity (exponent ``zipf_s``), each
  request one document and a fresh question, Poisson arrivals. Sized by the caller so that the
  documents together are larger than one server's KV cache but fit the pool.
- ``generated-shared-prefix``: the shape of SGLang's ``bench_serving --dataset-name
  generated-shared-prefix`` (``num_groups`` system prompts, ``prompts_per_group`` questions
  each, all requests shuffled), with its lengths scaled down for a CPU; Poisson arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.wallclock.workloads import TimedRequest, build_workload

SGLANG_WORKLOADS = ("conversation", "hot-document", "generated-shared-prefix")


@dataclass(frozen=True)
class HotDocumentShape:
    num_docs: int = 40
    doc_len: int = 256
    question_len: int = 32
    output_len: int = 16
    zipf_s: float = 1.1

    @property
    def docs_tokens(self) -> int:
        return self.num_docs * self.doc_len


@dataclass(frozen=True)
class SharedPrefixShape:
    """SGLang's defaults are 64 groups x 16 prompts, a 2048-token system prompt, 128-token
    questions and 256 output tokens; these are those lengths / 4 (outputs / 16)."""

    num_groups: int = 16
    prompts_per_group: int = 16
    system_len: int = 512
    question_len: int = 32
    output_len: int = 16


def build_sglang_workload(name: str, *, seed: int, num_requests: int, vocab_size: int,
                          hot: HotDocumentShape = HotDocumentShape(),
                          gsp: SharedPrefixShape = SharedPrefixShape()) -> list[TimedRequest]:  # fmt: skip
    """``num_requests`` requests of workload ``name``, sorted by arrival; the same arguments
    give the same list. Raises ``ValueError`` naming a bad argument."""
    if name not in SGLANG_WORKLOADS:
        raise ValueError(f"name: expected one of {SGLANG_WORKLOADS}, got {name!r}")
    if name == "conversation":
        return build_workload(name, seed=seed, num_requests=num_requests, vocab_size=vocab_size)
    for arg, value, low in (("seed", seed, 0), ("num_requests", num_requests, 1),
                            ("vocab_size", vocab_size, 2)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg}: expected an int >= {low}, got {value!r}")
    rng = np.random.default_rng([seed, SGLANG_WORKLOADS.index(name)])
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0, num_requests - 1))])
    if name == "hot-document":
        prefixes, output_len, question_len = _hot_documents(rng, hot, num_requests, vocab_size)
    else:
        prefixes, output_len, question_len = _shared_prefixes(rng, gsp, num_requests, vocab_size)
    return [
        TimedRequest(
            f"{name[0]}{i}",
            float(t),
            tuple(int(x) for x in (*p, *rng.integers(0, vocab_size, question_len))),
            output_len,
            None,
        )  # fmt: skip
        for i, (t, p) in enumerate(zip(arrivals, prefixes, strict=True))
    ]


def _hot_documents(rng, hot: HotDocumentShape, num_requests: int, vocab_size: int):
    if hot.num_docs < 1 or hot.doc_len < 1 or not hot.zipf_s >= 0:
        raise ValueError(f"hot: expected num_docs, doc_len >= 1 and zipf_s >= 0, got {hot!r}")
    docs = rng.integers(0, vocab_size, (hot.num_docs, hot.doc_len))
    weights = 1.0 / np.arange(1, hot.num_docs + 1) ** hot.zipf_s
    picks = rng.choice(hot.num_docs, num_requests, p=weights / weights.sum())
    return [docs[k] for k in picks], hot.output_len, hot.question_len


def _shared_prefixes(rng, gsp: SharedPrefixShape, num_requests: int, vocab_size: int):
    total = gsp.num_groups * gsp.prompts_per_group
    if gsp.num_groups < 1 or gsp.prompts_per_group < 1 or total < num_requests:
        raise ValueError(f"gsp: expected num_groups x prompts_per_group >= num_requests "
                         f"({num_requests}), got {gsp!r}")  # fmt: skip
    systems = rng.integers(0, vocab_size, (gsp.num_groups, gsp.system_len))
    order = rng.permutation(total)[:num_requests]  # SGLang shuffles the group-ordered list
    return [systems[k // gsp.prompts_per_group] for k in order], gsp.output_len, gsp.question_len
