"""The serving comparison's argument parsing, client command lines, result parsing (on a
captured ``sglang.bench_serving`` output) and 4-vs-1 ratios; no servers are started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenlake.benchmarks.wallclock import serving_compare as sc

CAPTURED = Path(__file__).parent / "data" / "bench_serving_output.txt"


def test_parses_the_captured_client_summary():
    figures = sc.parse_bench_output(CAPTURED.read_text())
    assert figures == {
        "completed": 8.0,
        "duration_s": 0.75,
        "request_throughput": 10.70,
        "output_throughput": 342.49,
        "mean_e2e_ms": 724.08,
        "median_e2e_ms": 729.25,
        "mean_ttft_ms": 222.62,
        "mean_tpot_ms": 16.18,
        "median_tpot_ms": 15.95,
    }


def test_a_failed_run_has_no_summary():
    text = CAPTURED.read_text().split("============ Serving Benchmark Result")[0]
    with pytest.raises(ValueError, match="mean_e2e_ms"):
        sc.parse_bench_output(text)


def test_defaults_and_quick():
    args = sc.parse_args([])
    assert args.models == ["tiny-random", "bench-model"] and args.instances == [1, 4]
    assert args.datasets == ["random-ids", "generated-shared-prefix"]
    assert args.loads == ["light", "saturation"] and args.num_prompts == 30
    quick = sc.parse_args(["--quick", "--instances", "1", "2"])
    assert quick.models == ["tiny-random"] and quick.num_prompts == 8 and quick.instances == [1, 2]


@pytest.mark.parametrize(
    "argv",
    [["--instances", "0"], ["--num-prompts", "0"], ["--models", "gpt"], ["--loads", "heavy"]],
)
def test_bad_arguments_exit(argv, capsys):
    with pytest.raises(SystemExit):
        sc.parse_args(argv)
    assert "serving-compare" in capsys.readouterr().err


def test_client_command_lines():
    args = sc.parse_args(["--num-prompts", "12", "--gsp-groups", "4"])
    light = sc.client_argv(args, "random-ids", "light", 8123, "m", Path("/tok"))
    sat = sc.client_argv(args, "generated-shared-prefix", "saturation", 8123, "m", Path("/tok"))
    assert light[1] == "-c" and light[2] == sc.CLIENT_BOOT

    def flag(argv, name):
        return argv[argv.index(name) + 1]

    assert flag(light, "--backend") == "vllm"
    assert flag(light, "--base-url") == "http://127.0.0.1:8123"
    assert flag(light, "--num-prompts") == "12" and flag(light, "--max-concurrency") == "1"
    assert "--max-concurrency" not in sat
    assert flag(sat, "--gsp-prompts-per-group") == "3"  # 12 prompts over 4 groups
    assert flag(sat, "--dataset-name") == "generated-shared-prefix"


def test_ratios_are_most_instances_over_fewest():
    base = dict(model="tiny-random", dataset="random-ids", load="light")
    results = [
        dict(base, num_instances=1, mean_tpot_ms=2.0, mean_e2e_ms=100.0, output_throughput=300.0),
        dict(base, num_instances=4, mean_tpot_ms=3.0, mean_e2e_ms=120.0, output_throughput=240.0),
        dict(base, load="saturation", num_instances=1, mean_e2e_ms=50.0, output_throughput=10.0),
    ]
    rows = sc.ratio_rows(results)
    assert rows == [
        dict(base, instances="4/1", tpot=1.5, e2e=1.2, throughput=0.8),
    ]  # the saturation case has one instance count only: no ratio
    table = sc.format_table(rows)
    assert "4/1" in table and "1.50" in table and "0.80" in table


def test_data_planes_side_by_side():
    args = sc.parse_args(["--data-planes", "local", "workers"])
    assert args.data_planes == ["local", "workers"]
    base = dict(model="m", dataset="random-ids", load="saturation", num_instances=2)
    rows = sc.plane_rows([
        {**base, "data_plane": "local", "output_throughput": 100.0, "mean_tpot_ms": 2.0,
         "mean_e2e_ms": 50.0, "tokens_per_cpu_s": 300.0},
        {**base, "data_plane": "workers", "output_throughput": 150.0, "mean_tpot_ms": 1.0,
         "mean_e2e_ms": 40.0, "tokens_per_cpu_s": 285.0},
    ])  # fmt: skip
    assert rows == [dict(model="m", dataset="random-ids", load="saturation", instances="2",
                         planes="workers/local", tpot=0.5, e2e=0.8, throughput=1.5,
                         tokens_per_cpu_s=0.95)]  # fmt: skip
    assert "workers/local" in sc.format_table(rows)
    assert sc.tree_cpu_seconds(os.getpid()) > 0
