"""The measured CPU profile and the simulator's wall-clock setups, against independent
references: step times counted by hand from the model's dimensions, a fit that must give back
the profile that made its rows, a fixed measured profile reproducing its own rows, a shared
host checked against brute-force time stepping, and the served runs' session and SLO rules."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tokenlake.benchmarks.calibrate.vs_real import goodput, read_real
from tokenlake.benchmarks.sim.cpu_profile import (
    DECODE,
    PREFILL,
    CpuProfile,
    MeasuredRow,
    _profile,
    fit_cpu_profile,
    load_cpu_profile,
)
from tokenlake.benchmarks.sim.metrics import RequestRecord
from tokenlake.benchmarks.sim.served_cpu import (
    Arrival,
    ServedSettings,
    attainment,
    simulate_served,
    to_requests,
)
from tokenlake.benchmarks.sim.systems.shared_servers import SharedHost
from tokenlake.cluster.profiles import ModelProfile

DATA = Path(__file__).parent / "data"
TINY = ModelProfile("tiny", 2, 64, 4, 2, 16, 128, 100, "float32")
CASES = [
    MeasuredRow(PREFILL, b, n, p, 1.0)
    for n, b, p in ((16, 1, 0), (256, 1, 0), (512, 1, 0), (64, 4, 0), (32, 1, 2048), (128, 2, 512))
] + [MeasuredRow(DECODE, b, 1, c, 1.0) for b, c in ((1, 32), (1, 4096), (16, 256), (32, 1024))]


def by_hand(m: ModelProfile, x, row: MeasuredRow) -> float:
    """The roofline step time counted from the model's dimensions (fp32, TP 1)."""
    inv_flops, inv_bw, prefill_oh, decode_oh, row_oh = x
    h, kv, L = m.hidden_size, m.num_kv_heads * m.head_dim, m.num_layers
    per_layer = 2 * h * m.num_q_heads * m.head_dim + 2 * h * kv + 3 * h * m.intermediate_size
    matmul, head = L * per_layer, m.vocab_size * h  # no embedding gather in the matmuls
    kv_bytes = 2 * L * kv * 4
    attn = 4 * L * m.num_q_heads * m.head_dim  # FLOPs per (row, key)
    weights = (L * per_layer + head) * 4
    b, n, p = row.batch, row.new_len, row.prefix_len
    pairs = b * n * (n + 1) / 2
    flops = 2 * (matmul * b * n + head * b) + attn * pairs
    t = max(flops * inv_flops, (weights + b * n * kv_bytes) * inv_bw) + row_oh * b
    q_o = 2 * L * m.num_q_heads * m.head_dim * 4
    if row.phase == DECODE:
        ctx = b * p
        return decode_oh + t + max(attn * ctx * inv_flops, (ctx * kv_bytes + q_o) * inv_bw)
    query = max(attn * n * p * inv_flops, (p * kv_bytes + n * q_o) * inv_bw) if p else 0.0
    return prefill_oh + t + b * query


X = (1 / 5e10, 1 / 2e10, 1.2e-3, 0.9e-3, 3e-5)


def test_step_times_match_a_count_by_hand():
    profile = _profile("tiny", TINY, X, 5e-4, 2, CASES)
    for row in CASES:
        assert profile.predict(row) == pytest.approx(by_hand(TINY, X, row), rel=1e-9), row


def test_fit_gives_back_the_profile_that_made_the_rows():
    truth = _profile("tiny", TINY, X, 5e-4, 2, CASES)
    rows = [r._replace(seconds=truth.predict(r)) for r in CASES]
    fitted = fit_cpu_profile("tiny", TINY, rows, 5e-4, 2)
    for r in rows:
        assert fitted.predict(r) == pytest.approx(r.seconds, rel=1e-3), r
    assert fitted.hop_s == 5e-4 and fitted.host_cores == 2
    assert fitted.hardware.net_latency_s == pytest.approx(5e-4 / (2 * TINY.num_layers))
    again = fit_cpu_profile("tiny", TINY, rows, 5e-4, 2)
    assert again == fitted  # deterministic


@pytest.mark.parametrize("model", ["tiny-random", "bench-model"])
def test_measured_profiles_reproduce_their_own_rows(model):
    """Profiles measured with ``tokenlake bench calibrate-cpu`` on the development machine:
    refitting their rows gives the same profile, and it reproduces every row within 20%."""
    profile = load_cpu_profile(DATA / f"cpu_profile_{model}.json")
    assert len(profile.rows) >= 15 and {r.phase for r in profile.rows} == {PREFILL, DECODE}
    refit = fit_cpu_profile(
        profile.name, profile.model, profile.rows, profile.hop_s, profile.host_cores
    )
    for r in profile.rows:
        assert refit.predict(r) == pytest.approx(profile.predict(r), rel=1e-6)
        assert abs(profile.predict(r) / r.seconds - 1) <= 0.20, r


def test_profile_json_round_trip_and_bad_files(tmp_path):
    import dataclasses

    from tokenlake.benchmarks.sim.cpu_profile import ServingCost

    costs = (ServingCost(1, 1, 4e-3, 2e-4, 3e-4), ServingCost(4, 2, 9e-3, 1e-3, 6e-4))
    profile = dataclasses.replace(_profile("tiny", TINY, X, 5e-4, 2, CASES), serving=costs)
    assert CpuProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert profile.serving_cost(1) == costs[0] and profile.serving_cost(3) == costs[1]
    assert _profile("tiny", TINY, X, 5e-4, 2, CASES).serving_cost(4)[2:] == (0.0, 0.0, 0.0)
    raw = profile.to_json()
    raw["serving"][0]["token_s"] = -1.0
    with pytest.raises(ValueError, match="serving"):
        CpuProfile.from_json(raw)
    with pytest.raises(ValueError, match="format"):
        CpuProfile.from_json({"format": "something-else"})
    raw = profile.to_json()
    del raw["hop_s"]
    with pytest.raises(ValueError, match="hop_s"):
        CpuProfile.from_json(raw)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_cpu_profile(bad)


def test_spec_carries_the_measured_calibration():
    profile = _profile("tiny", TINY, X, 5e-4, 2, CASES)
    spec = profile.spec(4, cache_tokens=3072)
    assert spec.mp is TINY and spec.hw is profile.hardware and spec.capacity_tokens == 3072
    from tokenlake.benchmarks.sim.step_timer import make_timer

    assert make_timer(spec).config == profile.timer  # not the GPU calibration


def brute_force_host(cores, speedup, work: list[float], dt: float = 1e-5) -> list[float]:
    """Finish times of tasks all started at 0, stepped in ``dt``."""
    left, done, t = list(work), [math.nan] * len(work), 0.0
    while any(math.isnan(d) for d in done):
        active = [i for i, d in enumerate(done) if math.isnan(d)]
        rate = min(speedup, cores / len(active))
        t += dt
        for i in active:
            left[i] -= rate * dt
            if left[i] <= 1e-12:
                done[i] = t
    return done


@pytest.mark.parametrize("cores, speedup", [(1, 1), (2, 1), (2, 1.5), (3, 2)])
def test_shared_host_against_time_stepping(cores, speedup):
    work = [0.010, 0.004, 0.007, 0.001]
    host = SharedHost(cores, speedup)
    for i, w in enumerate(work):
        host.add(i, w)
    finishes = host.finishes()
    expected = brute_force_host(cores, speedup, work)
    for i in range(len(work)):
        assert finishes[i] == pytest.approx(expected[i], abs=5e-5)
    host.advance(0.002)  # part of the way, then the rest: the same ends
    for i, end in host.finishes().items():
        assert end == pytest.approx(expected[i], abs=5e-5)
    with pytest.raises(ValueError, match="cores"):
        SharedHost(0)
    with pytest.raises(ValueError, match="speedup"):
        SharedHost(2, 3)


def test_block_ids_are_equal_exactly_up_to_the_shared_prefix():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 90, 100).tolist()
    prompts = [doc + [1, 2, 3], doc + [4, 5], doc[:40], rng.integers(0, 90, 50).tolist()]
    reqs = to_requests(prompts, [4, 4, 4, 4], 32)
    a, b, c, d = (r.block_ids for r in reqs)
    assert a[:3] == b[:3] and a[3] != b[3]  # 96 tokens shared: 3 whole blocks
    assert c[0] == a[0] and c[1] != a[1]  # 40 tokens: block 0, then a partial block
    assert not set(d) & set(a)
    assert [r.input_len for r in reqs] == [103, 102, 40, 50]


def served(system, prompts, sends, sessions, limit_s=60.0):
    profile = load_cpu_profile(DATA / "cpu_profile_tiny-random.json")
    assert profile.serving  # the stored profile has the serving path's costs
    reqs = to_requests(prompts, [6] * len(prompts), 32)
    arrivals = [Arrival(r, s, x) for r, s, x in zip(reqs, sends, sessions, strict=True)]
    return simulate_served(system, profile, ServedSettings(), arrivals, limit_s, 32)


@pytest.mark.parametrize("system", ["tokenlake", "router"])
def test_a_session_turn_waits_for_the_previous_answer(system):
    rng = np.random.default_rng(1)
    first = rng.integers(0, 90, 300).tolist()
    second = first + rng.integers(0, 90, 40).tolist()
    other = rng.integers(0, 90, 200).tolist()
    records, _ = served(system, [first, second, other], [0.0, 0.001, 0.001], ["s", "s", None])
    a, b, c = records
    assert all(r.finished for r in records)
    assert b.arrival_s == pytest.approx(a.finish_s)  # sent once the first turn answered
    assert c.arrival_s == pytest.approx(0.001)  # no session: sent at its time
    assert b.num_tokens == 6 and b.first_token_s > b.arrival_s


def test_a_run_is_cut_at_its_limit():
    prompts = [np.random.default_rng(i).integers(0, 90, 200).tolist() for i in range(4)]
    records, _ = served("tokenlake", prompts, [0.0] * 4, [None] * 4, limit_s=1e-4)
    assert not any(r.finished for r in records)
    assert attainment(records, 1e9, 1e9) == 0.0


def test_attainment_rule_against_the_records():
    def rec(ttft, gap, finished=True):
        r = RequestRecord(0, 1.0, 10, 3, 1.0, (1.0, 0.0))
        r.emit(1.0 + ttft)
        r.emit(1.0 + ttft + gap)
        if finished:
            r.emit(1.0 + ttft + 2 * gap)
        return r

    records = [rec(0.1, 0.01), rec(0.3, 0.01), rec(0.1, 0.05), rec(0.1, 0.01, False)]
    assert attainment(records, ttft_s=0.2, tpot_s=0.02) == 0.25
    assert attainment(records, ttft_s=0.31, tpot_s=0.051) == 0.75


def test_goodput_and_reading_real_lines(tmp_path):
    assert goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.5)]) == 2.0
    assert goodput([(1.0, 0.5)]) == 0.0
    point = {"bench": "wallclock-router", "kind": "point", "system": "router",
             "model": "tiny-random", "workload": "conversation", "seed": 0, "rate": 2,
             "num_requests": 10, "attainment": 0.9, "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}  # fmt: skip
    f = tmp_path / "real.jsonl"
    f.write_text(json.dumps(point) + "\n" + json.dumps({**point, "rate": 1}) + "\n")
    points, goodputs = read_real(f)
    assert [p["rate"] for p in points[("tiny-random", "conversation", 0, "router")]] == [1.0, 2.0]
    assert goodputs == {}
    f.write_text(json.dumps({**point, "slo": {}}) + "\n")
    with pytest.raises(ValueError, match="real.jsonl:1"):
        read_real(f)
    from tokenlake.benchmarks.calibrate.vs_real import main

    for bad in (f, tmp_path / "missing.jsonl"):  # a usage error naming the file, nothing run
        with pytest.raises(SystemExit) as e:
            main(["--real", str(bad)])
        assert e.value.code == 2


def test_calibration_times_every_case_on_the_real_engine():
    """On a clock that ticks once per reading, every timed run is one tick: each case is
    timed alone, once per repeat, and the hop (remote minus local) is 0."""
    pytest.importorskip("torch")
    from tokenlake.benchmarks.calibrate.hardware import QUICK_DECODE, QUICK_PREFILL, measure
    from tokenlake.benchmarks.real.cluster import load_model

    ticks = iter(range(10**6))
    rows, hop = measure(
        load_model("tiny-random", 0), repeats=2, quick=True, clock=lambda: next(ticks)
    )
    assert [(r.batch, r.new_len, r.prefix_len) for r in rows if r.phase == PREFILL] == [
        (b, n, p) for n, b, p in QUICK_PREFILL
    ]
    assert [(r.batch, r.prefix_len) for r in rows if r.phase == DECODE] == list(QUICK_DECODE)
    assert all(r.seconds == 1 for r in rows) and hop == 0.0


def test_a_served_pool_runs_one_forward_per_step_whatever_its_lanes():
    """The in-process data plane runs every sub-batch's rows in one forward: with a 1 s
    fixed cost per decode step and everything else nearly free, every gap between tokens
    is one fixed cost, however many instances the decodes are spread over."""
    x = (1e-15, 1e-15, 0.0, 1.0, 0.0)
    profile = _profile("tiny", TINY, x, 0.0, 2, CASES)
    prompts = [np.random.default_rng(i).integers(0, 90, 32).tolist() for i in range(4)]
    reqs = to_requests(prompts, [4] * 4, 32)
    arrivals = [Arrival(r, 0.0, None) for r in reqs]
    records, _ = simulate_served("tokenlake", profile, ServedSettings(), arrivals, 100.0, 32)
    assert all(r.finished for r in records)
    for r in records:
        assert 1.0 - 1e-6 <= r.max_tbt_s <= 1.0 + 0.05  # the control plane's CPU time on top


def test_sim_vs_real_command_end_to_end(tmp_path, capsys):
    """``tokenlake bench sim-vs-real`` on wall-clock lines (made up here, with the real
    schema) and a stored profile: a table row per model x workload x system, a point line
    per real point with the real figure carried over, a goodput line per sweep."""
    from tokenlake.benchmarks.calibrate.vs_real import main

    base = {"bench": "wallclock-router", "model": "tiny-random", "workload": "long-document",
            "seed": 0, "num_instances": 4, "num_requests": 12,
            "slo": {"ttft_s": 0.5, "tpot_s": 0.05}}  # fmt: skip
    lines = [
        {**base, "kind": "point", "system": s, "rate": r, "attainment": a}
        for s in ("tokenlake", "router")
        for r, a in ((2.0, 1.0), (8.0, 0.5))
    ] + [{**base, "kind": "goodput", "system": s, "p90_goodput": 2.0} for s in ("tokenlake",)]
    real = tmp_path / "real.jsonl"
    real.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    profile = DATA / "cpu_profile_tiny-random.json"
    assert main(["--real", str(real), "--hardware-profile", str(profile)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(x) for x in out if x.startswith("{")]
    table = [x for x in out if x.startswith("| tiny-random")]
    assert [x.split(" | ")[2] for x in table] == ["router", "tokenlake"]
    points = [r for r in rows if r["kind"] == "point"]
    assert len(points) == 4 and all(0 <= r["sim_attainment"] <= 1 for r in points)
    assert {(r["system"], r["rate"], r["real_attainment"]) for r in points} == {
        (x["system"], x["rate"], x["attainment"]) for x in lines if x["kind"] == "point"
    }
    assert all(r["sim_slo"]["ttft_s"] > 0 and r["sim_slo"]["tpot_s"] > 0 for r in points)
    goodputs = {r["system"]: r for r in rows if r["kind"] == "goodput"}
    assert goodputs["tokenlake"]["real_p90_goodput"] == 2.0  # the real sweep's own
    assert goodputs["router"]["real_p90_goodput"] == 2.0  # from its points


def test_idle_costs_make_the_simulated_solo_the_real_one():
    """The background load and cost per request read from a real run's batch-size-1
    figures give those figures back when the simulated server runs the same probe (within
    5%: the control plane's measured CPU time is charged beside the host's share)."""
    from tokenlake.benchmarks.sim.served_cpu import idle_costs, probe, solo_latency
    from tokenlake.benchmarks.wallclock.workloads import build_workload

    profile = load_cpu_profile(DATA / "cpu_profile_tiny-random.json")
    timed = build_workload("long-document", seed=0, num_requests=12, vocab_size=90)
    req = probe(timed, 32)
    ttft, tpot = solo_latency(profile, ServedSettings(), req, 32)
    real = {"ttft_s": 10 * (1.5 * ttft + 0.05), "tpot_s": 10 * 1.5 * tpot}
    settings = idle_costs(profile, ServedSettings(), timed, real, 32)
    assert settings.background_threads >= 2 * 1.5 - 1
    got = solo_latency(profile, settings, req, 32)
    assert got[0] == pytest.approx(real["ttft_s"] / 10, rel=0.05)
    assert got[1] == pytest.approx(real["tpot_s"] / 10, rel=0.05)
    fast = {"ttft_s": 10 * ttft / 2, "tpot_s": 10 * tpot / 2}  # faster than the profile
    bare = idle_costs(profile, ServedSettings(), timed, fast, 32)
    assert bare.background_threads == 0 and bare.request_overhead_s == 0


def test_serving_costs_are_read_on_a_real_server():
    """Against a real ``tokenlake serve`` (tiny-random, one instance): a single stream takes
    one iteration per token, the costs solved for are finite and not negative."""
    pytest.importorskip("httpx")
    from tokenlake.benchmarks.calibrate.serving import measure_serving

    profile = load_cpu_profile(DATA / "cpu_profile_tiny-random.json")
    got = measure_serving(
        "tiny-random", profile, 1, 1, batch=2, max_tokens=8, num_solo=2, prompt_len=300
    )
    # the single stream: its prompt (and the tokenizer's BOS) in 256-token chunks, then one
    # iteration per token after the first
    assert got.detail["iterations"][1] == 2 + 7
    assert got.detail["iterations"][0] == 2  # one iteration per one-token request
    assert 2 + 7 <= got.detail["iterations"][2] <= 2 * (2 + 7)  # the pair, mostly together
    assert all(0 <= x < 1 for x in got.cost[2:])


def test_goodput_harness_runs_on_a_measured_profile(tmp_path, capsys):
    """``tokenlake goodput --hardware-profile FILE``: the cluster is the profile's (its
    hardware and model, one core per instance), and a bad file is an error naming it."""
    from tokenlake.benchmarks.goodput.harness import main

    profile = DATA / "cpu_profile_tiny-random.json"
    argv = ["--workload", "sharegpt", "--requests", "6", "--systems", "tokenlake,router",
            "--rates", "1", "--prefill-tokens", "512", "--segment-len", "32", "--seeds", "1",
            "--wall-budget", "120"]  # fmt: skip
    assert main(["--hardware-profile", str(profile), *argv]) == 0
    out = capsys.readouterr()
    assert "4 instances x TP1 CPU (tiny-random, measured), tiny-random" in out.err + out.out
    runs = [json.loads(x) for x in out.out.splitlines() if x.startswith("{")]
    assert {r["system"] for r in runs if "total" in r} == {"tokenlake", "router"}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["--hardware-profile", str(bad), *argv]) != 0
    assert "bad.json" in capsys.readouterr().err
