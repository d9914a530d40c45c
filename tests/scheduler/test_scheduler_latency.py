"""Latency model fitting and the roofline cost model."""

from __future__ import annotations

import numpy as np
import pytest

from tokenlake.cluster.profiles import A100_80G, H100, H200, LLAMA2_7B, LLAMA3_8B, LWM_7B_1M
from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler.cost_model import CostModel, split_rows
from tokenlake.scheduler.latency_model import (
    DECODE,
    PREFILL,
    Coeffs,
    LatencyModel,
    ProfileRow,
    fit_coeffs,
    fit_latency_model,
)


def synthetic_rows(coeffs: Coeffs, phase: str, dop: int, rng, n: int = 40, noise: float = 0.0):
    rows = []
    for _ in range(n):
        log_lengths = rng.uniform(0, np.log(20000), int(rng.integers(1, 6)))
        lengths = tuple(int(x) for x in np.exp(log_lengths).round())
        if phase == DECODE:
            lengths = (1,) * int(rng.integers(1, 300))
        s1, s2 = sum(lengths), sum(x * x for x in lengths)
        t = coeffs.a + coeffs.b * s1 + coeffs.c * s2
        rows.append(ProfileRow(phase, dop, lengths, t * (1 + noise * rng.standard_normal())))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_fit_recovers_known_coefficients(seed):
    rng = np.random.default_rng(seed)
    truth = {
        k: Coeffs(
            rng.uniform(5e-3, 5e-2), rng.uniform(1e-5, 1e-4) / k, rng.uniform(1e-10, 1e-9) / k
        )
        for k in (1, 2, 4)
    }
    decode = Coeffs(rng.uniform(5e-3, 5e-2), rng.uniform(1e-5, 1e-4), 0.0)
    rows = [r for k, c in truth.items() for r in synthetic_rows(c, PREFILL, k, rng)]
    rows += synthetic_rows(decode, DECODE, 1, rng)
    model = fit_latency_model(rows)
    assert sorted(model.prefill) == [1, 2, 4]
    for k, want in truth.items():
        np.testing.assert_allclose(model.prefill[k], want, rtol=0.01)
    # decode rows have sum(l) == sum(l^2): only a and b + c are identifiable
    got = model.decode
    np.testing.assert_allclose([got.a, got.b + got.c], [decode.a, decode.b], rtol=0.01)


def test_fit_minimizes_relative_error_with_noise():
    rng = np.random.default_rng(5)
    truth = Coeffs(0.02, 3e-5, 4e-10)
    rows = synthetic_rows(truth, PREFILL, 1, rng, n=400, noise=0.01)
    fit = fit_coeffs(rows)
    for lengths in [(1,), (100, 200), (20000,), (9000, 9000, 9000)]:
        s1, s2 = sum(lengths), sum(x * x for x in lengths)
        assert fit.predict(s1, s2) == pytest.approx(truth.predict(s1, s2), rel=0.01)


def test_model_extrapolates_dop_and_applies_load():
    model = LatencyModel({1: Coeffs(1.0, 2.0, 4.0), 2: Coeffs(1.0, 1.2, 2.2)}, Coeffs(1, 1, 0))
    assert model.coeffs(PREFILL, 4) == Coeffs(1.0, 0.6, 1.1)  # from DoP 2, ideal scaling
    np.testing.assert_allclose(model.table(3)[2], [1.0, 0.8, 2.2 * 2 / 3], rtol=1e-12)
    assert model.predict(PREFILL, [1, 2], 1, load=0.5) == pytest.approx(2 * (1 + 6 + 20))
    with pytest.raises(InvalidArgumentError, match="dop"):
        model.coeffs(DECODE, 2)
    with pytest.raises(InvalidArgumentError, match="rows"):
        fit_latency_model([ProfileRow(DECODE, 1, (1,), 1.0)])
    with pytest.raises(InvalidArgumentError, match="LatencyModel.prefill"):
        LatencyModel({}, Coeffs(1, 1, 0))


def test_split_rows_matches_a_near_equal_contiguous_split():
    for lengths, dop in [((5,), 2), ((3, 4, 9), 3), ((1, 1, 1, 1), 4), ((100, 1), 3)]:
        subs = split_rows(lengths, dop)
        sizes = [sum(e - f for f, e in sub) for sub in subs]
        assert sum(sizes) == sum(lengths) and max(sizes) - min(sizes) <= 1
        flat = [(i, f, e) for sub in subs for i, (f, e) in enumerate(sub)]
        assert all(0 <= f < e for _, f, e in flat)


def test_cost_model_roofline():
    cm = CostModel(A100_80G, LLAMA2_7B)
    m = LLAMA2_7B
    embed = m.vocab_size * m.hidden_size
    weights = (m.num_params - embed) * 2
    # one decode token: memory bound on the weights (+ its KV write)
    want = (weights + m.shape.kv_bytes_per_token) / A100_80G.mem_bandwidth
    assert cm.batch_time([1]) == pytest.approx(want)
    # a long prefill chunk is compute bound: matmuls + causal attention among its tokens
    n = 16384
    flops = 2 * (m.num_params - 2 * embed) * n + 2 * embed
    flops += 4 * m.num_layers * m.num_q_heads * m.head_dim * n * (n + 1) / 2
    assert cm.batch_time([n]) == pytest.approx(flops / A100_80G.peak_flops)
    # sequence parallelism helps a long chunk; later sub-batches do more attention
    assert cm.batch_time([n], 4) < cm.batch_time([n], 2) < cm.batch_time([n])
    # a holder's prefix attention for one decode row over 100K cached tokens: memory bound
    kv = 100_000 * m.shape.kv_bytes_per_token
    assert cm.query_time(1, 100_000) == pytest.approx(
        (kv + 2 * m.num_layers * m.shape.q_bytes_per_token_layer) / A100_80G.mem_bandwidth
    )
    assert cm.transfer_time(1e9) == pytest.approx(10e-6 + 1e9 / 400e9)
    with pytest.raises(InvalidArgumentError, match="dop"):
        cm.batch_time([3], 4)


@pytest.mark.parametrize("hardware", [A100_80G, H100, H200], ids=lambda h: h.name)
@pytest.mark.parametrize("model", [LLAMA2_7B, LWM_7B_1M, LLAMA3_8B], ids=lambda m: m.name)
def test_fit_to_cost_model_rows(hardware, model):
    """The quadratic form fits the roofline's rows (a max of two lines) closely."""
    cm = CostModel(hardware, model)
    rows = cm.profile_rows(dops=(1, 2, 4), rows_per_dop=40, seed=1)
    fitted = fit_latency_model(rows)
    errors = [abs(fitted.predict(r.phase, r.lengths, r.dop) / r.seconds - 1) for r in rows]
    assert np.median(errors) < 0.1 and max(errors) < 0.6  # worst at the roofline knee
    assert all(min(c) >= 0 for c in fitted.prefill.values())
