"""The table of every command the README and docs/*.md show, and how each is checked: run
with tiny arguments (:class:`Tiny`), served (:class:`Served`), run by another test
(:class:`Covered`), or not runnable here and why (:class:`NotHere`). Read by
``test_readme.py``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiny:
    """Run the README command, with ``extra`` arguments appended (later options win), in a
    scratch directory holding ``my_trace.jsonl.gz``."""

    extra: str = ""
    timeout_s: float = 300


@dataclass(frozen=True)
class Served:
    """Run against ``tokenlake serve`` started with tiny arguments on a free port."""


@dataclass(frozen=True)
class Covered:
    """Run by another test (``path::name``, which must exist)."""

    test: str


@dataclass(frozen=True)
class NotHere:
    """Cannot run on this machine; why."""

    reason: str


RAY_MACHINES = (
    "needs machines reachable over SSH; tests/serve/ray/test_deploy_config.py validates "
    "deploy/ray-cluster.yaml against Ray's own schema"
)
# the launch detached, a completion from it, the stop: on a 3-node Ray cluster on 127.0.0.1
RAY_CLI = "tests/serve/ray/test_ray_launch.py::test_cli_detached_launch_serves_and_stops_by_name"
RAY_FOREGROUND = (
    "tests/serve/ray/test_ray_cli.py::test_cli_launch_serves_until_ctrl_c_then_removes_everything"
)
SGLANG_HOST = "tests/sglang/test_sglang_host.py::test_workers_join_a_host_process_by_config_keys"
GOODPUT_TINY = "--requests 6 --max-evals 1 --seeds 1 --prefill-tokens 2048 --wall-budget 120"
COMMANDS = {
    "make demo": Covered("tests/serve/test_demo.py::test_demo_runs_and_matches_transformers"),
    "make test": NotHere("the test command itself (CI runs it)"),
    ".venv/bin/tokenlake --help": Tiny(),
    ".venv/bin/tokenlake trace my_trace.jsonl.gz": Tiny(),
    ".venv/bin/tokenlake goodput --trace my_trace.jsonl.gz --time-scale 1 "
    "--systems tokenlake,router": Tiny("--seeds 1"),
    ".venv/bin/tokenlake goodput --trace my_trace.jsonl.gz --goodput "
    "--out results/goodput/mine": Tiny("--systems tokenlake,router --seeds 1 --max-evals 1 "
                                       "--prefill-tokens 2048"),
    ".venv/bin/tokenlake serve --model tiny-random --num-instances 4": Served(),
    "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
    '-d \'{"prompt": "Hello", "max_tokens": 16, "temperature": 0}\'': Served(),
    "curl http://127.0.0.1:8000/metrics": Served(),
    "pip install .": Covered("tests/packaging/test_wheel.py::"
                             "test_wheel_installs_and_runs_outside_the_repository"),
    'pip install ".[serve,model]"': Covered("tests/packaging/test_wheel.py::"
                                            "test_wheel_installs_and_runs_outside_the_repository"),
    'pip install ".[sglang]"': NotHere("SGLang's CUDA torch; tests/sglang use SGLang without it"),
    "echo '{\"num_instances\": 4, \"num_slots\": 4096, \"segment_len\": 64}' > tokenlake.json":
        Tiny(),
    "python -m sglang.launch_server --model-path Qwen/Qwen2.5-0.5B-Instruct "
    "--attention-backend tokenlake --tokenlake-config tokenlake.json --mem-fraction-static 0.6":
        NotHere("SGLang's server needs a GPU (../shared/notes/ecosystem.md); tests/sglang run "
                "the backend on SGLang's own objects, tests/sglang/test_sglang_memory.py "
                "computes that it fits one 80 GB GPU"),
    "tokenlake sglang-host --model-path /models/Qwen2.5-0.5B-Instruct --config tokenlake.json "
    "--port 7600 --secret-file /run/tokenlake/secret": Covered(SGLANG_HOST),
    "echo '{\"control_endpoint\": \"tcp://127.0.0.1:7600\", \"secret_file\": "
    "\"/run/tokenlake/secret\", \"instance_id\": 0}' > worker0.json": Covered(SGLANG_HOST),
    "python -m sglang.launch_server --model-path /models/Qwen2.5-0.5B-Instruct "
    "--attention-backend tokenlake --tokenlake-config worker0.json --port 30000": Covered(
        "tests/sglang/test_sglang_real_servers.py::"
        "test_prefixes_shared_across_servers_are_exact_and_hit_across_workers"
    ),
    "SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --model-path DIR --device cpu "
    "--dtype float32 --max-total-tokens 4096 --attention-backend tokenlake --tokenlake-config "
    "worker0.json --port 30000": Covered(
        "tests/sglang/test_sglang_real_servers.py::"
        "test_prefixes_shared_across_servers_are_exact_and_hit_across_workers"
    ),
    'pip install "ray==2.60.0"': NotHere("a workstation's Ray for `ray up`; make test installs "
                                         "the same version"),
    "ray up deploy/ray-cluster.yaml": NotHere(RAY_MACHINES),
    "ray attach deploy/ray-cluster.yaml": NotHere(RAY_MACHINES),
    "cd ~/tokenlake && tokenlake launch --address auto --instances 4 --nodes 2 "
    "--model tiny-random --detach": Covered(RAY_CLI),
    "curl http://<head>:8000/v1/completions -H 'Content-Type: application/json' "
    '-d \'{"prompt": "Hello", "max_tokens": 16, "temperature": 0}\'': Covered(RAY_CLI),
    "tokenlake launch --address auto --stop": Covered(RAY_CLI),
    # a foreground launch on a local Ray of its own, a completion from it, Ctrl-C
    ".venv/bin/tokenlake launch --instances 2 --port 18431": Covered(RAY_FOREGROUND),
    "curl http://127.0.0.1:18431/v1/completions -H 'Content-Type: application/json' "
    '-d \'{"prompt": "Hello", "max_tokens": 16, "temperature": 0}\'': Covered(RAY_FOREGROUND),
    "ray down deploy/ray-cluster.yaml": NotHere(RAY_MACHINES),
    ".venv/bin/tokenlake bench attention": Tiny(
        "--prefix-lens 512 --repeats 1 --warmup 0 --flush-mib 8 --boundary-prefix-lens 16 "
        "--boundary-calls 10 --decode-heads 8 2 64 --prefill-heads 4 2 64"
    ),
    ".venv/bin/tokenlake bench plans": Tiny("--quick --skip-replay"),
    ".venv/bin/tokenlake bench dataplane": Tiny("--quick"),
    ".venv/bin/tokenlake bench page-groups": Tiny("--quick"),
    ".venv/bin/tokenlake bench cross-node": Tiny("--quick --no-launch --prefixes 256 --reps 2"),
    ".venv/bin/tokenlake bench scheduler": Tiny("--quick"),
    ".venv/bin/tokenlake bench model": Tiny("--quick"),
    ".venv/bin/tokenlake bench real-cluster": Tiny("--quick"),
    '.venv/bin/python -m pip install "sglang-router==0.3.2"': NotHere(
        "installs a package; make test installs the same version (the Makefile's router stamp)"
    ),
    ".venv/bin/tokenlake bench wallclock --quick": Tiny(),
    ".venv/bin/tokenlake bench wallclock-sglang --sglang-pythonpath tests/sglang/cpu_support/site "
    "--quick --slo-ttft-ms 5000 --slo-tpot-ms 2000": Covered(
        "tests/benchmarks/test_wallclock_sglang.py::test_tiny_run_of_both_sides"
    ),
    ".venv/bin/tokenlake bench wallclock-sglang --sglang-pythonpath tests/sglang/cpu_support/site "
    "--num-servers 2 --seeds 0 1 2 --slo-file results/wallclock_sglang_slo.json --json-out "
    "results/wallclock-sglang.jsonl": NotHere(
        "about an hour of real SGLang servers on a 2-core machine; the --quick line runs the same code"
    ),
    ".venv/bin/tokenlake bench wallclock-sglang --sglang-pythonpath tests/sglang/cpu_support/site "
    "--num-servers 4 --seeds 0 1 2 --max-evals 3 --no-sweep --solo --workloads hot-document "
    "generated-shared-prefix --slo-file results/wallclock_sglang_slo.json --json-out "
    "results/wallclock-sglang.jsonl": NotHere(
        "eight real SGLang servers need about 15 GB and an hour; the --quick line runs the same code"
    ),
    ".venv/bin/tokenlake bench wallclock --models tiny-random --seeds 0 1 2 --requests 30 "
    "--max-evals 4 --rel-tol 0.5 --json-out results/wallclock.jsonl": NotHere(
        "about 15 minutes on a 2-core machine; the --quick line above runs the same code"
    ),
    ".venv/bin/tokenlake bench wallclock --models bench-model --seeds 0 1 2 --requests 20 "
    "--max-evals 4 --rel-tol 0.5 --min-rate 0.2 --drain-s 20 --json-out "
    "results/wallclock.jsonl": NotHere(
        "about 25 minutes on a 2-core machine; the --quick line above runs the same code"
    ),
    ".venv/bin/tokenlake bench wallclock --models tiny-random --seeds 0 1 2 --requests 30 "
    "--max-evals 4 --rel-tol 0.5 --slo-aware --json-out results/wallclock-aware.jsonl": NotHere(
        "about 6 minutes on a 2-core machine; tests/scheduler/test_sync_tbt.py covers the "
        "scheduling --slo-aware turns on in every server"
    ),
    ".venv/bin/tokenlake bench wallclock --models bench-model --seeds 0 1 2 --requests 20 "
    "--max-evals 4 --rel-tol 0.5 --min-rate 0.2 --drain-s 20 --slo-aware --json-out "
    "results/wallclock-aware.jsonl": NotHere(
        "about 16 minutes on a 2-core machine; the --quick line above runs the same code"
    ),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems tokenlake "
    "--prefill-tokens 2048 --goodput --seeds 3 --rel-tol 0.15 --max-evals 5 --jobs 2 --lo 1.5 "
    "--hi 2 --out results/goodput/conv_tl": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems tokenlake "
    "--prefill-tokens 2048 --holder-priority --overlap-scheduling --goodput --seeds 3 --rel-tol "
    "0.15 --max-evals 5 --jobs 2 --lo 1.73 --hi 2.3 --out results/goodput/conv_tl_levers": Covered(
        "tests/benchmarks/test_layered_timing.py::"
        "test_overlap_scheduling_hides_the_calls_behind_the_running_iteration"
    ),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems "
    "router-tbt,mooncake --baseline-prefill-tokens 2048,8192 --goodput --seeds 3 --rel-tol 0.15 "
    "--max-evals 6 --jobs 2 --lo 0.5 --hi 2 --out results/goodput/conv_base": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems "
    "router,mooncake --baseline-prefill-tokens 8192 --router-balance 64:1.5 "
    "--baseline-schedule-policies fcfs --baseline-evictions lru --no-mixed-chunk --goodput "
    "--seeds 1 --rel-tol 0.15 --max-evals 5 --lo 0.3 --hi 1.5 --out "
    "results/goodput/conv_shipped": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload scbench --requests 1000 --think-scale 0 --horizon "
    "20000 --systems tokenlake,router,mooncake --prefill-tokens 2048 --baseline-prefill-tokens "
    "2048,8192 --goodput --seeds 3 --rel-tol 0.15 --max-evals 5 --jobs 2 --lo 0.1 --hi 0.4 "
    "--out results/goodput/scbench": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload agentic --requests 1000 --num-sessions 256 "
    "--systems tokenlake,router,mooncake --prefill-tokens 2048 --baseline-prefill-tokens "
    "2048,8192 --goodput --seeds 3 --rel-tol 0.15 --max-evals 5 --jobs 2 --lo 0.1 --hi 0.5 "
    "--out results/goodput/agentic": NotHere(
        "256 sessions even at 6 requests: minutes on a 2-core machine; the SCBench-like line "
        "above runs the same code"
    ),
    ".venv/bin/tokenlake goodput --workload loogle --requests 1000 --systems "
    "tokenlake,router-tbt-cascade,mooncake --prefill-tokens 2048 --baseline-prefill-tokens "
    "2048,8192 --goodput --seeds 3 --rel-tol 0.15 --max-evals 5 --jobs 2 --lo 1 --hi 4 --out "
    "results/goodput/loogle": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems tokenlake "
    "--prefill-tokens 2048 --rates 1.73,2.0 --seeds 1": Tiny("--requests 6 --wall-budget 120"),
    ".venv/bin/tokenlake goodput --workload loogle --requests 1000 --systems "
    "tokenlake,tokenlake-tier --prefill-tokens 2048 --rates 3,5 --seeds 1 --jobs 2 "
    "--wall-budget 4000 --out results/goodput/loogle_tier_rates": Tiny(
        "--requests 6 --wall-budget 120"
    ),
    ".venv/bin/tokenlake goodput --workload loogle --requests 1000 --systems "
    "tokenlake,tokenlake-tier --prefill-tokens 2048 --goodput --seeds 1 --rel-tol 0.15 "
    "--max-evals 3 --jobs 2 --lo 3 --hi 5 --wall-budget 4000 --out "
    "results/goodput/loogle_tier": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake bench calibrate-control-plane": Covered(
        "tests/benchmarks/test_goodput_determinism.py::test_the_fit_recovers_a_linear_cost"
    ),
    "B=router,router-tbt,router-tbt-cascade,mooncake-1p3d,mooncake-3p1d": NotHere("a shell variable for the lines below"),
    "T=tokenlake,tokenlake-no-groups": NotHere("a shell variable for the lines below"),
    ".venv/bin/tokenlake goodput --workload synthetic --requests 1000 --systems $T "
    "--prefill-tokens 2048 --goodput --seeds 3 --rel-tol 0.15 --max-evals 6 --jobs 2 --lo "
    "1 --hi 4.4 --out results/goodput/synthetic_tl": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload synthetic --requests 1000 --systems $B "
    "--goodput --seeds 3 --rel-tol 0.15 --max-evals 6 --jobs 2 --lo 0.2 --hi 4 --out "
    "results/goodput/synthetic_base": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload sharegpt --requests 1000 --systems $T "
    "--prefill-tokens 2048 --goodput --seeds 3 --rel-tol 0.15 --max-evals 6 --jobs 2 --lo "
    "5 --hi 100 --out results/goodput/sharegpt_tl": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload sharegpt --requests 1000 --systems "
    "$B,mooncake-1p3d-cascade --goodput --seeds 3 --rel-tol 0.15 --max-evals 6 --jobs 2 "
    "--lo 1 --hi 40 --out results/goodput/sharegpt_base": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake goodput --workload conversation --requests 1000 --systems "
    "tokenlake,router,mooncake-3p1d-no-store --prefill-tokens 2048 --dist-attn-pricing "
    "overlap --control-plane-scale 0 --rpc-latency-us 0 --goodput --seeds 1 --rel-tol "
    "0.15 --max-evals 6 --jobs 2 --lo 0.1 --hi 3 --out "
    "results/goodput/conversation_lenient": Tiny(GOODPUT_TINY),
    ".venv/bin/tokenlake bench sim-crosscheck": Tiny(),
    ".venv/bin/tokenlake bench calibrate-cpu --model tiny-random --out "
    "results/cpu_profile_tiny-random.json": Tiny("--quick --repeats 1 --no-serving"),
    ".venv/bin/tokenlake bench calibrate-cpu --model bench-model --out "
    "results/cpu_profile_bench-model.json": Tiny("--quick --repeats 1 --no-serving"),
    ".venv/bin/tokenlake bench sim-vs-real --real results/wallclock.jsonl --hardware-profile "
    "results/cpu_profile_tiny-random.json --hardware-profile "
    "results/cpu_profile_bench-model.json": Covered(
        "tests/benchmarks/test_sim_vs_real.py::test_sim_vs_real_command_end_to_end"
    ),
}  # fmt: skip
