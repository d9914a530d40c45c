"""Composing a server from its :class:`ServeConfig`: checkpoint → model and tokenizer →
pool → data plane → compute engine → (profiled) elastic scheduler → :class:`Runtime`."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.engines.model.tiny import TINY_RANDOM, write_tiny_random
from tokenlake.engines.model.tokenizer import Tokenizer
from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler import (
    Coeffs,
    ElasticScheduler,
    LatencyModel,
    SchedulerConfig,
    default_cases,
    fit_latency_model,
    measure_hop_seconds,
    measure_rows,
)
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.runtime import Runtime

log = logging.getLogger(__name__)

# bytes per second between two instances of one host (shared memory): converts the measured
# hop seconds into the traffic bytes dispatch and placement weigh. Only the order matters: a
# hop (~1 ms) is then worth megabytes, far more than a decode's query rows (kilobytes) and
# less than a long prefill's.
LINK_BYTES_PER_S = 10e9
# the start-up profile: prefill cases per DoP (3 parameters are fitted per DoP: more cases
# than that keep one noisy case from setting them), runs per case and a bound on its time
PROFILE_PREFILL_CASES = 6
PROFILE_REPEATS = 5
PROFILE_MAX_SECONDS = 30.0


@dataclass(frozen=True)
class Served:
    """A running runtime and what the HTTP layer needs besides it."""

    runtime: Runtime
    tokenizer: Tokenizer | None
    model_path: Path
    config: ServeConfig


def build(config: ServeConfig, engine_factory: Callable | None = None) -> Served:
    """Load, compose and start everything ``config`` describes (the caller closes
    ``served.runtime``). ``engine_factory(model, pool, closers)`` replaces the engine over a
    local data plane (the Ray launch runs compute in the instances' own processes); what it
    appends to ``closers`` runs when the runtime closes."""
    closers = []
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    try:
        path = _model_path(config, closers)
        model = LlamaModel.from_dir(path, config.dtype)
        tokenizer = Tokenizer.from_dir(path)
        if engine_factory is not None and config.host_tier_gb:
            raise InvalidArgumentError(
                "host_tier_gb: the host tier runs with --data-plane local or mp, not in the "
                f"instances' own processes; got {config.host_tier_gb!r}"
            )
        pool_config = tl.PoolConfig(
            model.shape, config.num_instances, config.num_slots, config.segment_len,
            namespace=f"{config.model_name}:{model.dtype}",
            num_tier_blocks=tier_blocks(config.host_tier_gb, model.shape, config.segment_len),
        )  # fmt: skip
        max_len = _max_model_len(config, model, pool_config)
        workers = engine_factory is None and config.data_plane == "workers"
        in_process = engine_factory is not None or workers  # no cluster in this process
        cluster = None if in_process else _cluster(config, pool_config, closers)
        latency = _latency(config, model, pool_config, cluster, workers)
        # the dispatcher and placement weigh a hop in bytes: its seconds at the link's rate
        balancer = BalancerConfig(hop_bytes=latency.hop_s * LINK_BYTES_PER_S)
        pool = tl.Pool(pool_config, balancer=balancer)
        if engine_factory is not None:
            engine = engine_factory(model, pool, closers)
        elif workers:
            from tokenlake.serve.worker_plane import make_engine as make_workers

            engine = make_workers(
                str(path), config.dtype, model, pool_config, config.max_num_seqs, max_len,
                config.chunk_len, config.kernel_backend,
                max(1, config.torch_threads // config.num_instances), closers,
            )  # fmt: skip
        elif config.data_plane == "compute":
            from tokenlake.serve.local_compute import make_engine

            threads = max(1, config.torch_threads // config.num_instances)
            engine = make_engine(str(path), config.dtype, threads, model, cluster, closers)
        else:
            engine = ModelEngine(model, cluster)
        parallel = engine_factory is not None or config.data_plane in ("compute", "workers")
        sched_config = SchedulerConfig(
            config.num_instances,
            config.segment_len,
            mode=config.scheduler_mode,
            chunk_len=config.chunk_len,
            # local/mp: one process computes every instance's dense layers, so batches do
            # not run in parallel; compute processes (here or in the Ray launch) do, one
            # batch per process: no DoP across processes
            compute_lanes=0 if parallel else 1,
            max_dop=1 if parallel else 0,
            tbt_slo=config.tbt_slo_ms / 1e3 if config.tbt_slo_ms > 0 else math.inf,
            # workers: each instance steps on its own; an iteration starts as one frees up
            sync_iterations=not workers,
        )
        scheduler = ElasticScheduler(sched_config, latency, pool)
        eos = model.config.eos_token_ids
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = (tokenizer.eos_token_id,)
        runtime_class = Runtime
        if workers:
            from tokenlake.serve.async_runtime import AsyncRuntime as runtime_class
        runtime = runtime_class(
            engine, scheduler, max_len, config.max_num_seqs, eos, config.seed, tuple(closers)
        )
        return Served(runtime.start(), tokenizer, path, config)
    except BaseException:
        for close in reversed(closers):
            close()
        raise


def tier_blocks(host_tier_gb: float, shape: tl.ModelShape, segment_len: int) -> int:
    """Segments ``host_tier_gb`` GiB of host memory hold (the host tier's blocks)."""
    return int(host_tier_gb * (1 << 30)) // (segment_len * shape.kv_bytes_per_token)


def _model_path(config: ServeConfig, closers: list) -> Path:
    if config.model == TINY_RANDOM:
        tmp = tempfile.TemporaryDirectory(prefix="tokenlake-tiny-random-")
        closers.append(tmp.cleanup)
        return write_tiny_random(Path(tmp.name), seed=config.seed)
    path = Path(config.model)
    if not path.is_dir():
        raise InvalidArgumentError(
            f"model: {config.model!r} is not a checkpoint directory (or {TINY_RANDOM!r}); "
            "weights are never downloaded"
        )
    return path


def _max_model_len(config: ServeConfig, model: LlamaModel, pool_config: tl.PoolConfig) -> int:
    # one request must fit the whole pool with a segment to spare per instance
    capacity = (pool_config.num_slots - 1) * pool_config.num_instances * pool_config.segment_len
    mc = model.config
    bounds = [
        (mc.max_position_embeddings, f"max_position_embeddings={mc.max_position_embeddings}"),
        (capacity, f"the pool's capacity ((num_slots - 1) x num_instances x segment_len = {capacity})"),
    ]  # fmt: skip
    windowed = mc.max_context_len < mc.max_position_embeddings
    if windowed:
        bounds.append((
            mc.max_context_len,
            f"the sliding window (sliding_window={mc.sliding_window}; prefix attention reads "
            "every cached segment, it does not apply the window)",
        ))  # fmt: skip
    limit, why = min(bounds)
    if config.max_model_len > limit:
        raise InvalidArgumentError(
            f"max_model_len: {config.max_model_len} exceeds {limit}, the most {why} allows"
        )
    if windowed and not config.max_model_len and limit == mc.max_context_len:
        log.warning(
            "max_model_len: capped at %d tokens instead of max_position_embeddings=%d by %s",
            limit, mc.max_position_embeddings, why,
        )  # fmt: skip
    return config.max_model_len or limit


def _cluster(config: ServeConfig, pool: tl.PoolConfig, closers: list):
    if config.data_plane == "local":
        from tokenlake.engines.clusters.local import LocalCluster

        return LocalCluster(pool, backend=config.kernel_backend)
    from tokenlake.engines.clusters.mp import MPCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig

    rows = config.chunk_len * config.num_instances + config.max_num_seqs
    cluster = MPCluster(
        pool, DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows), backend=config.kernel_backend
    )
    closers.append(cluster.close)
    return cluster


def _latency(config: ServeConfig, model: LlamaModel, pool, cluster, workers: bool) -> LatencyModel:
    """The scheduler's latency model: read from ``--latency-model-file`` when that file
    exists; else profiled (and the hop measured on the served data plane), then written
    there when a file is named; a fixed guess with ``--no-profile``."""
    path = Path(config.latency_model_file) if config.latency_model_file else None
    if path is not None and path.is_file():
        latency = load_latency_model(path)
        log.info("latency model (from %s): %s", path, latency.summary())
        return latency
    if not config.profile:
        return LatencyModel({1: Coeffs(1e-3, 1e-5, 1e-9)}, Coeffs(1e-3, 1e-5, 0.0))
    latency = profile_latency_model(
        model, config.num_instances, config.segment_len, config.chunk_len, config.kernel_backend
    )
    if cluster is not None or workers:
        latency = latency.with_hop(_hop_seconds(config, model, pool, cluster))
    log.info("latency model: %s", latency.summary())
    if path is not None:
        path.write_text(json.dumps(latency.to_dict(), indent=2) + "\n")
        log.info("latency model: written to %s (read from there at the next start)", path)
    return latency


def load_latency_model(path: Path) -> LatencyModel:
    """The latency model in the JSON file at ``path`` (``LatencyModel.to_dict``'s form)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"latency_model_file: cannot read {path}: {e}") from None
    try:
        return LatencyModel.from_dict(data)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"latency_model_file: {path}: {e}") from None


def _hop_seconds(config: ServeConfig, model: LlamaModel, pool: tl.PoolConfig, cluster) -> float:
    # The served data plane itself, on a scratch pool of the same geometry: a hop's cost is
    # the processes' round trip and signals, which an in-process cluster would not show.
    if config.num_instances < 2:
        return 0.0
    cfg = pool
    scratch = tl.Pool(dataclasses.replace(cfg, num_slots=4))
    if config.data_plane in ("local", "workers"):  # a worker reads peers in place, in-process
        from tokenlake.engines.clusters.local import LocalCluster

        local = LocalCluster(scratch, backend=config.kernel_backend)
        return measure_served_hop(model, local, scratch)
    cluster.reset(scratch, config.kernel_backend)
    try:
        return measure_served_hop(model, cluster, scratch)
    finally:
        cluster.reset(pool, config.kernel_backend)


def measure_served_hop(model: LlamaModel, cluster, pool: tl.Pool, repeats: int = 5) -> float:
    """Seconds of one remote holder per step on ``cluster`` serving ``pool`` (see
    :func:`tokenlake.scheduler.measure_hop_seconds`); ``pool`` is left as it was."""
    engine = ModelEngine(model, cluster)

    def execute(plans: tl.Plans, chunks) -> None:
        engine.run(plans, chunks)
        engine.retire(plans)

    hop_s = measure_hop_seconds(pool, execute, repeats=repeats, vocab=model.config.vocab_size)
    log.info("latency model: hop_s=%.6f", hop_s)
    return hop_s


def profile_latency_model(
    model: LlamaModel,
    num_instances: int,
    segment_len: int,
    chunk_len: int,
    backend: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = PROFILE_REPEATS,
    max_seconds: float = PROFILE_MAX_SECONDS,
) -> LatencyModel:
    """Fit the scheduler's ``T(batch, k)`` on this model and machine (a few seconds, on a
    scratch pool so a served pool's cache and counters stay clean); each case the median
    of ``repeats`` runs timed on ``clock`` (a run slowed by another process does not move
    it), the repeats cut to one per case once ``max_seconds`` have passed."""
    from tokenlake.engines.clusters.local import LocalCluster

    dops = tuple(range(1, min(num_instances, 4) + 1))
    max_len = min(chunk_len, 256)
    cases = default_cases(dops, max_len=max_len, num_prefill=PROFILE_PREFILL_CASES)
    slots = 4 * 4 * max_len // segment_len + 8
    pool = tl.Pool(tl.PoolConfig(model.shape, max(dops), slots, segment_len))
    engine = ModelEngine(model, LocalCluster(pool, backend=backend))
    rows = measure_rows(
        pool, lambda plans, chunks: engine.run(plans, chunks), cases, repeats=repeats,
        vocab=engine.model.config.vocab_size, clock=clock, statistic=statistics.median,
        max_seconds=max_seconds,
    )  # fmt: skip
    fitted = fit_latency_model(rows)
    if not all(math.isfinite(x) for x in fitted.decode):
        raise InvalidArgumentError("profile: the latency fit failed")
    return fitted
