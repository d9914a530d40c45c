"""``tokenlake bench wallclock-sglang``: the same SGLang engine on both sides, wall clock.

    tokenlake bench wallclock-sglang --sglang-pythonpath tests/sglang/cpu_support/site --quick
    tokenlake bench wallclock-sglang --sglang-pythonpath tests/sglang/cpu_support/site \\
        --num-servers 2 4 --seeds 0 1 2 --json-out results.jsonl

TokenLake: N ``sglang.launch_server --attention-backend tokenlake`` servers joined to one
``tokenlake sglang-host`` pool, behind the SGLang router with a load-only policy
(``round_robin`` and ``power_of_two``). Baseline: N SGLang servers with their own radix caches
behind ``sglang_router --policy cache_aware``, at its defaults and at the best of a small
threshold sweep (picked per workload on the first seed, at twice the first rate). Equal KV
tokens per server (the TokenLake server's split between SGLang's cache and its pool
instance), the same chunked-prefill size. Both sides stay up for a model and N; every run sends
fresh text; the systems' goodput searches alternate run by run.

The SLO is fixed: read from ``--slo-file`` (per model and workload), measured there once when
missing (10x the batch-size-1 TTFT and TPOT of the workload's median prompt on one idle
baseline server, before any run), or given with ``--slo-ttft-ms``/``--slo-tpot-ms``; it is
printed every invocation. On a machine without a GPU, SGLang's CPU engine needs import
stand-ins for torchvision and sgl_kernel: ``--sglang-pythonpath`` names the folder
(this repository's ``tests/sglang/cpu_support/site``). JSON lines (stdout and ``--json-out``):
``kind`` "slo", "sweep", "point" and "goodput"; a table at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenlake.benchmarks.demo.client import quiet_http_client_logs
from tokenlake.benchmarks.wallclock.client import ALPHABET
from tokenlake.benchmarks.wallclock.measure import Slo
from tokenlake.benchmarks.wallclock.processes import Fleet, ProcessError, require_router
from tokenlake.benchmarks.wallclock.serving_compare import prepare_model
from tokenlake.benchmarks.wallclock.sglang.point import (
    measure_solo,
    read_slo_file,
    run_point,
    warm_up,
    write_slo_file,
)
from tokenlake.benchmarks.wallclock.sglang.report import format_table
from tokenlake.benchmarks.wallclock.sglang.sides import (
    SGLangSettings,
    add_router,
    start_baseline,
    start_tokenlake,
)
from tokenlake.benchmarks.wallclock.sglang.workloads import (
    SGLANG_WORKLOADS,
    HotDocumentShape,
    build_sglang_workload,
)
from tokenlake.benchmarks.wallclock.sweep import TARGET, first_rate_only, search_all

MODELS = ("tiny-random", "bench-model")
BENCH = "wallclock-sglang"
TOKENLAKE_POLICIES = ("round_robin", "power_of_two")
# the threshold sweep around cache_aware's defaults (0.3, 64, 1.5): balance sooner, keep
# affinity longer, or both
SWEEP = {"cache_aware": (), "ca-t0.5-abs8": ("--cache-threshold", "0.5",
         "--balance-abs-threshold", "8", "--balance-rel-threshold", "1.5"),
         "ca-t0.3-abs2": ("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.2"),
         "ca-t0.1-abs4": ("--cache-threshold", "0.1", "--balance-abs-threshold", "4",
                          "--balance-rel-threshold", "1.1")}  # fmt: skip
TUNED = "cache_aware-tuned"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenlake bench wallclock-sglang", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", choices=MODELS, default=["tiny-random"])
    p.add_argument("--num-servers", nargs="+", type=int, default=[2], help="N per side")
    p.add_argument("--workloads", nargs="+", choices=SGLANG_WORKLOADS,
                   default=list(SGLANG_WORKLOADS))  # fmt: skip
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--requests", type=int, default=24, help="requests per run")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV tokens per server")
    p.add_argument("--tokenlake-sglang-tokens", type=int, default=3072,
                   help="of those, a TokenLake server's SGLang cache; its pool instance gets "
                        "the rest")  # fmt: skip
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--segment-len", type=int, default=32)
    p.add_argument("--hot-docs", type=int, default=HotDocumentShape.num_docs,
                   help="hot-document: documents")  # fmt: skip
    p.add_argument("--hot-doc-len", type=int, default=HotDocumentShape.doc_len)
    p.add_argument("--slo-file", type=Path, default=Path("wallclock_sglang_slo.json"))
    p.add_argument("--recalibrate", action="store_true", help="measure the SLO again")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="with --slo-tpot-ms: no file")
    p.add_argument("--slo-tpot-ms", type=float, default=0.0)
    p.add_argument("--lo", type=float, default=0.0, help="first rate; 0: N x 0.5 / solo E2E")
    p.add_argument("--rel-tol", type=float, default=0.3)
    p.add_argument("--max-evals", type=int, default=4, help="most runs per search")
    p.add_argument("--drain-s", type=float, default=20.0)
    p.add_argument("--no-sweep", action="store_true", help="cache_aware at its defaults only")
    p.add_argument("--solo", action="store_true",
                   help="first, each workload's median prompt alone on one idle server of each "
                        "side: batch-size-1 TTFT and TPOT (kind 'solo')")  # fmt: skip
    p.add_argument("--sglang-pythonpath", default="",
                   help="first on every SGLang process's PYTHONPATH (CPU import stand-ins)")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None, help="keep every process's output here")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--quick", action="store_true",
                   help="tiny-random, N=2, hot-document, seed 0, 8 requests, one rate, no sweep")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("requests", "max_evals", "max_total_tokens", "tokenlake_sglang_tokens",
                 "chunked_prefill_size", "segment_len", "hot_docs", "hot_doc_len"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.num_servers) or any(s < 0 for s in args.seeds):
        p.error(f"--num-servers >= 1, --seeds >= 0: got {args.num_servers}, {args.seeds}")
    if bool(args.slo_ttft_ms > 0) != bool(args.slo_tpot_ms > 0):
        p.error("--slo-ttft-ms and --slo-tpot-ms: give both (> 0) or neither")
    if args.quick:
        args.models, args.num_servers, args.workloads = ["tiny-random"], [2], ["hot-document"]
        args.seeds, args.requests, args.no_sweep = [0], 8, True
    return args


def log(msg: str) -> None:
    print(f"[wallclock-sglang {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(line: dict, json_out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if json_out is not None:
        with open(json_out, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: every process group is stopped


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        require_router()
    except ProcessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quiet_http_client_logs()
    lines: list[dict] = []
    salts = itertools.count(1)
    with tempfile.TemporaryDirectory(prefix="tokenlake-wallclock-sglang-") as tmp, \
            Fleet(args.start_timeout_s, args.log_dir) as fleet:  # fmt: skip
        for model in args.models:
            for n in args.num_servers:
                lines += run_sides(args, fleet, model, n, Path(tmp), salts)
    print(format_table(lines))
    return 0


def run_sides(args, fleet, model: str, n: int, tmp: Path, salts) -> list[dict]:
    """Start both sides for ``model`` and ``n``, run every workload and seed, stop them."""
    model_dir = prepare_model(model, tmp / model, 0)
    settings = SGLangSettings(model_dir, model, args.max_total_tokens, args.chunked_prefill_size,
                              args.tokenlake_sglang_tokens, args.segment_len, args.device,
                              args.sglang_pythonpath)  # fmt: skip
    hot = HotDocumentShape(num_docs=args.hot_docs, doc_len=args.hot_doc_len)
    log(f"{model} N={n}: starting both sides (KV per server {settings.max_total_tokens} tokens; "
        f"TokenLake: SGLang {settings.tokenlake_sglang_tokens} + pool {settings.pool_slots} x "
        f"{settings.segment_len}; hot documents {hot.docs_tokens} tokens)")  # fmt: skip
    starts = {"baseline": (start_baseline, fleet, settings, n),
              "tokenlake": (start_tokenlake, fleet, settings, n, tmp / f"host-{model}-{n}")}  # fmt: skip
    sides = dict(zip(starts, _at_once(fleet, list(starts.values())), strict=True))
    out: list[dict] = []
    try:
        base, tl = sides["baseline"], sides["tokenlake"]
        for side in sides.values():
            side.note_shm()
        slos = resolve_slos(args, model, base.servers[0], salts, hot)
        routers = [(tl, f"tokenlake-{policy}", ("--policy", policy))
                   for policy in TOKENLAKE_POLICIES]  # fmt: skip
        routers += [(base, label, extra) for label, extra
                    in (SWEEP if not args.no_sweep else {"cache_aware": ()}).items()]  # fmt: skip
        _at_once(fleet, [(add_router, fleet, *r) for r in routers])  # each takes ~30 s
        for side in (tl, base):  # in the order listed, whichever started first
            side.routers = {name: side.routers[name] for s, name, _ in routers if s is side}
        for url in (*base.servers, *tl.servers):
            warm_up(url, model)
        for workload in args.workloads if args.solo else ():  # one server of each side, idle
            reqs = build_sglang_workload(workload, seed=0, num_requests=args.requests,
                                         vocab_size=len(ALPHABET), hot=hot)  # fmt: skip
            for side in (base, tl):
                solo = measure_solo(side.servers[0], model, reqs, salts)
                emit({"bench": BENCH, "kind": "solo", "model": model, "num_servers": n,
                      "workload": workload, "side": side.name, "ttft_s": solo["solo_ttft_s"],
                      "tpot_s": solo["solo_tpot_s"], "e2e_s": solo["solo_e2e_s"]},
                     args.json_out)  # fmt: skip
        for workload in args.workloads:
            per_seed = {s: build_sglang_workload(workload, seed=s, num_requests=args.requests,
                                                 vocab_size=len(ALPHABET), hot=hot)
                        for s in args.seeds}  # fmt: skip
            out += run_workload(args, fleet, sides, model, n, workload, per_seed, slos[workload],
                                settings, salts)  # fmt: skip
    finally:
        for side in sides.values():
            fleet.stop(side.procs)
            side.remove_shm()
    return out


def _at_once(fleet, calls: list[tuple]) -> list:
    """``fn(*args)`` for every ``(fn, *args)`` in threads (processes start in parallel); on
    any error or Ctrl-C the fleet is closed, so the other calls stop waiting at once."""
    ex = concurrent.futures.ThreadPoolExecutor(len(calls))
    try:
        return [f.result() for f in [ex.submit(*call) for call in calls]]
    except BaseException:
        fleet.close()
        raise
    finally:
        ex.shutdown(wait=False)


def resolve_slos(args, model: str, idle_url: str, salts, hot) -> dict[str, dict]:
    """Each workload's SLO: the flags, else the file, else measured now on ``idle_url`` (a
    baseline server no run has used yet) and written to the file."""
    if args.slo_ttft_ms > 0:
        fixed = {"ttft_s": args.slo_ttft_ms / 1e3, "tpot_s": args.slo_tpot_ms / 1e3,
                 "solo_e2e_s": 0.0, "source": "flags"}  # fmt: skip
        slos = dict.fromkeys(args.workloads, fixed)
    else:
        known = {} if args.recalibrate else read_slo_file(args.slo_file, model)
        missing = [w for w in args.workloads if w not in known]
        if missing:
            warm_up(idle_url, model)
            log(f"{model}: calibrating the SLO of {missing} on one idle baseline server")
            measured = {w: measure_solo(idle_url, model, build_sglang_workload(
                w, seed=0, num_requests=args.requests, vocab_size=len(ALPHABET), hot=hot),
                salts) for w in missing}  # fmt: skip
            write_slo_file(args.slo_file, model, measured)
            known = read_slo_file(args.slo_file, model)
        slos = {w: {**known[w], "source": str(args.slo_file)} for w in args.workloads}
    for w, slo in slos.items():
        log(f"{model} {w}: SLO TTFT <= {slo['ttft_s'] * 1e3:.1f} ms, every token gap <= "
            f"{slo['tpot_s'] * 1e3:.1f} ms ({slo['source']})")  # fmt: skip
        emit({"bench": BENCH, "kind": "slo", "model": model, "workload": w, **slo},
             args.json_out)  # fmt: skip
    return slos


def run_workload(args, fleet, sides, model, n, workload, per_seed, slo_entry, settings,
                 salts) -> list[dict]:  # fmt: skip
    slo = Slo(slo_entry["ttft_s"], slo_entry["tpot_s"])
    solo = slo_entry.get("solo_e2e_s") or 1.0
    lo = args.lo or round(0.5 * n / solo, 3)
    base, tl = sides["baseline"], sides["tokenlake"]
    side_of = {**dict.fromkeys(tl.routers, tl), **dict.fromkeys(base.routers, base)}
    key = {"bench": BENCH, "model": model, "workload": workload, "num_servers": n,
           "max_total_tokens": settings.max_total_tokens,
           "tokenlake_sglang_tokens": settings.tokenlake_sglang_tokens,
           "pool_slots": settings.pool_slots, "segment_len": settings.segment_len,
           "chunked_prefill_size": settings.chunked_prefill_size}  # fmt: skip
    out: list[dict] = []

    def point(system: str, seed: int, rate: float, kind: str = "point") -> dict:

        fleet.check_alive(side_of[system].procs)
        try:
            line = run_point(side_of[system], system, model, per_seed[seed], rate, next(salts),
                             slo, args.drain_s)  # fmt: skip
        except httpx.HTTPError:
            fleet.check_alive(side_of[system].procs)  # a dead server: its log's tail
            raise
        line = {**key, "kind": kind, "seed": seed, "system": system,
                "router_args": list(SWEEP.get(system, ())), **line,
                "load_avg": round(os.getloadavg()[0], 2)}  # fmt: skip
        log(f"  {model} N={n} {workload} seed {seed} {system:<22} {rate:7.2f} req/s: "
            f"attainment {line['attainment']:.0%}, hit {line['hit_rate']:.1%}, load CV "
            f"{line['load_cv']:.1%}, CPU {line['cpu_s_per_output_token'] or 0:.4f} s/token")  # fmt: skip
        emit(line, args.json_out)
        out.append(line)
        return line

    tuned = "cache_aware"
    if len(base.routers) > 1:  # the sweep: every candidate once, at twice the first rate
        first = args.seeds[0]
        tried = {label: point(label, first, 2 * lo, "sweep") for label in base.routers}
        tuned = max(tried, key=lambda k: (tried[k]["attainment"], -tried[k]["ttft_p90_s"]))
        log(f"  {model} N={n} {workload}: tuned cache_aware = {tuned} "
            f"{' '.join(SWEEP[tuned]) or '(its defaults)'}")  # fmt: skip
    systems = [*tl.routers, "cache_aware"] + ([tuned] if tuned != "cache_aware" else [])
    for seed in args.seeds:

        def attainment_at(system: str, rate: float, seed: int = seed) -> float:
            return point(system, seed, rate)["attainment"]

        if args.quick:
            results = first_rate_only(systems, attainment_at, lo)
        else:
            results = search_all(systems, attainment_at, lo=lo, hi=2 * lo, rel_tol=args.rel_tol,
                                 max_evals=args.max_evals, wait_s=7200.0)  # fmt: skip
        named = [(s, s) for s in results]
        if len(base.routers) > 1:  # the tuned router's lines (the default's, if it won)
            named = [(s, TUNED if s == tuned and s != "cache_aware" else s) for s in results]
            named += [("cache_aware", TUNED)] if tuned == "cache_aware" else []
        for system, name in named:
            r = results[system]
            line = {**key, "kind": "goodput", "seed": seed, "system": name, "router": system,
                    "router_args": list(SWEEP.get(system, ())),
                    "p90_goodput": round(r.goodput, 4),
                    "slo_missed_in_sweep": any(a < TARGET for _, a in r.points),
                    "points": [(round(x, 4), round(a, 4)) for x, a in r.points],
                    "slo": slo.as_dict(), "load_avg": round(os.getloadavg()[0], 2)}  # fmt: skip
            emit(line, args.json_out)
            out.append(line)
        log(f"  {model} N={n} {workload} seed {seed}: P90 goodput " + ", ".join(
            f"{s} {r.goodput:.2f}" for s, r in results.items()))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
