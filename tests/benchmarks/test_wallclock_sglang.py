"""The SGLang wall-clock bench: its workloads and table against brute force, and one tiny run
of the real thing (2 real SGLang servers per side on CPU, one TokenLake host, the real
router), asserting what every JSON line must hold, never a timing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tokenlake.benchmarks.wallclock.client import ALPHABET
from tokenlake.benchmarks.wallclock.sglang.report import summarize
from tokenlake.benchmarks.wallclock.sglang.sides import SGLangSettings, parse_sglang_counters
from tokenlake.benchmarks.wallclock.sglang.workloads import (
    SGLANG_WORKLOADS,
    HotDocumentShape,
    SharedPrefixShape,
    build_sglang_workload,
)

V = len(ALPHABET)
REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "tests" / "sglang" / "cpu_support" / "site"


@pytest.mark.parametrize("name", SGLANG_WORKLOADS)
def test_workloads_are_deterministic_per_seed(name):
    a = build_sglang_workload(name, seed=1, num_requests=30, vocab_size=V)
    assert a == build_sglang_workload(name, seed=1, num_requests=30, vocab_size=V)
    assert a != build_sglang_workload(name, seed=2, num_requests=30, vocab_size=V)
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] == 0.0 and len({r.request_id for r in a}) == 30
    assert all(0 <= t < V for r in a for t in r.prompt_ids)


def test_hot_documents_follow_zipf_and_share_whole_documents():
    hot = HotDocumentShape(num_docs=6, doc_len=40, question_len=8, zipf_s=1.2)
    reqs = build_sglang_workload("hot-document", seed=0, num_requests=3000, vocab_size=V, hot=hot)
    assert {len(r.prompt_ids) for r in reqs} == {48}
    counts = Counter(r.prompt_ids[:40] for r in reqs).most_common()
    assert len(counts) == hot.num_docs
    weights = 1.0 / np.arange(1, 7) ** 1.2
    got = np.array([c for _, c in counts]) / len(reqs)
    assert np.allclose(got, weights / weights.sum(), atol=0.03)  # brute-force frequencies
    assert len({r.prompt_ids[40:] for r in reqs}) > 2990  # questions are fresh


def test_shared_prefix_groups():
    gsp = SharedPrefixShape(num_groups=4, prompts_per_group=5, system_len=30, question_len=6)
    reqs = build_sglang_workload("generated-shared-prefix", seed=0, num_requests=20,
                                 vocab_size=V, gsp=gsp)  # fmt: skip
    groups = Counter(r.prompt_ids[:30] for r in reqs)
    assert sorted(groups.values()) == [5, 5, 5, 5]  # every prompt of every group, once
    with pytest.raises(ValueError, match="num_requests"):
        build_sglang_workload("generated-shared-prefix", seed=0, num_requests=21, vocab_size=V,
                              gsp=gsp)  # fmt: skip


def test_settings_split_the_kv_memory_and_refuse_bad_splits(tmp_path):
    s = SGLangSettings(tmp_path, "m", 8192, 512, 4096, segment_len=32)
    assert s.pool_slots * s.segment_len + s.tokenlake_sglang_tokens == s.max_total_tokens
    for bad in (0, 8192, 9000):
        with pytest.raises(ValueError, match="tokenlake_sglang_tokens"):
            SGLangSettings(tmp_path, "m", 8192, 512, bad)


def test_counters_sum_over_labels():
    text = ('# HELP x\nsglang:prompt_tokens_total{model_name="m"} 10.0\n'
            'sglang:prompt_tokens_total{model_name="n"} 5.0\nsglang:cached_tokens_total 3.0\n'
            'sglang:prompt_tokens_created 99.0\n')  # fmt: skip
    got = parse_sglang_counters(text)
    assert got["sglang:prompt_tokens_total"] == 15.0 and got["sglang:cached_tokens_total"] == 3.0
    assert got["sglang:generation_tokens_total"] == 0.0


def test_table_takes_the_best_tokenlake_policy_against_the_tuned_router():
    def g(system, seed, value, router=None):
        return {"kind": "goodput", "model": "m", "num_servers": 2, "workload": "w",
                "seed": seed, "system": system, "router": router or system,
                "p90_goodput": value, "slo_missed_in_sweep": True}  # fmt: skip

    lines = [g("tokenlake-round_robin", 0, 2.0), g("tokenlake-power_of_two", 0, 3.0),
             g("cache_aware", 0, 1.0), g("cache_aware-tuned", 0, 1.5, "ca-x"),
             g("tokenlake-round_robin", 1, 1.0), g("tokenlake-power_of_two", 1, 0.5),
             g("cache_aware", 1, 1.0), g("cache_aware-tuned", 1, 2.0, "ca-x")]  # fmt: skip
    (row,) = summarize(lines)
    assert row["baseline"] == "cache_aware-tuned"
    assert row["ratio"] == (1.25, 0.5, 2.0)  # seed 0: 3/1.5, seed 1: 1/2
    assert row["systems"]["cache_aware"]["goodput"] == (1.0, 1.0, 1.0)


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None
                    or importlib.util.find_spec("sglang") is None,
                    reason="needs sglang and sglang-router (make test installs them)")  # fmt: skip
def test_tiny_run_of_both_sides(tmp_path):
    out = tmp_path / "lines.jsonl"
    argv = [sys.executable, "-m", "tokenlake.benchmarks.wallclock.sglang.run", "--quick",
            "--sglang-pythonpath", str(SITE), "--slo-ttft-ms", "60000", "--slo-tpot-ms",
            "60000", "--drain-s", "240", "--json-out", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1500, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    (slo,) = [ln for ln in lines if ln["kind"] == "slo"]
    assert (slo["ttft_s"], slo["tpot_s"]) == (60.0, 60.0)  # the flags, printed and recorded
    reqs = build_sglang_workload("hot-document", seed=0, num_requests=8, vocab_size=V)
    points = {ln["system"]: ln for ln in lines if ln["kind"] == "point"}
    assert set(points) == {"tokenlake-round_robin", "tokenlake-power_of_two", "cache_aware"}
    prompt_len = sum(len(r.prompt_ids) for r in reqs)
    for p in points.values():
        assert p["num_servers"] == 2 and len(p["server_work_tokens"]) == 2
        assert p["finished"] == p["num_requests"] == len(reqs) and not p["errors"]
        assert p["output_tokens"] == sum(r.max_tokens for r in reqs)  # ignore_eos
        # every request reached exactly one server (the tokenizer may add one BOS token)
        assert prompt_len <= p["prompt_tokens"] <= prompt_len + len(reqs)
        assert 0 <= p["cached_tokens"] <= p["prompt_tokens"] and p["cpu_s"] > 0
        assert (
            p["pool_slots"] * p["segment_len"] + p["tokenlake_sglang_tokens"]
            == p["max_total_tokens"]
        )
    goodput = {ln["system"]: ln for ln in lines if ln["kind"] == "goodput"}
    assert set(goodput) == set(points)
    for system, g in goodput.items():
        rate, attained = g["points"][0]
        assert g["p90_goodput"] == (rate if attained >= 0.9 else 0.0)
        assert attained == points[system]["attainment"]
