"""The goodput harness's simulation runs: one at a time in this process, or ``jobs`` at once
in worker processes (``--jobs``), each reported here as it ends and kept for reuse.

A run is a pure function of its :class:`RunKey` and the harness's options (the workload, the
cluster and the system's seed), so where or when it runs does not change its result; only which
runs a bisection asks for does (:func:`tokenlake.benchmarks.sim.metrics.bisect_goodput` with
``width > 1`` probes several rates per round).

Runs waiting for a worker start lowest rate first: a run replays ``requests / rate`` seconds,
so the lowest rate is likely the longest (longest-first scheduling), and the system bisecting
at the lowest rates, whose chain of runs takes longest, does not wait behind shorter runs.
A worker with nothing waiting starts a run a bisection will ask for next if the runs it waits
for pass (``many(keys, then)``): a run that fails mostly stops early, so one still going
is likely to pass, and a wrong guess is a run at a higher rate, likely to stop early too.
A run started ahead is reported only when asked for; one never asked for is not reported.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Executor, Future, ProcessPoolExecutor
from typing import NamedTuple

from tokenlake.benchmarks.goodput.sim_options import control_plane_cost_of, pricing_of, store_of
from tokenlake.benchmarks.sim.engine import FCFS
from tokenlake.benchmarks.sim.runner import (
    SLO_MISSED,
    WALL_BUDGET,
    RunConfig,
    RunResult,
    simulate,
)
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.radix_cache import LRU
from tokenlake.benchmarks.workloads import Workload


class Setting(NamedTuple):
    """A baseline's setting beyond its prefill size, each None at the system's default: the
    router's imbalance thresholds ``(abs, rel)``, Mooncake's split ``(P, D)``, SGLang's
    schedule policy and radix eviction policy."""

    prefill: int
    balance: tuple[int, float] | None = None
    split: tuple[int, int] | None = None
    schedule: str | None = None
    eviction: str | None = None


# a run's knob: its prefill size, or a Setting
Knob = int | Setting


def knob_prefill(knob: Knob) -> int:
    return knob.prefill if isinstance(knob, Setting) else knob


def knob_setting(knob: Knob) -> Setting:
    return knob if isinstance(knob, Setting) else Setting(knob)


def knob_label(knob: Knob) -> str:
    """``2048``, with the settings that are not the defaults: ``2048 b32:1.0001 2P2D lpm
    slru`` (the router's imbalance thresholds, Mooncake's split, the schedule and eviction
    policies)."""
    k = knob_setting(knob)
    parts = [str(k.prefill)]
    if k.balance is not None:
        parts.append(f"b{k.balance[0]}:{k.balance[1]:g}")
    if k.split is not None:
        parts.append(f"{k.split[0]}P{k.split[1]}D")
    parts += [x for x in (k.schedule, k.eviction) if x is not None]
    return " ".join(parts)


class RunKey(NamedTuple):
    """One simulation: ``system`` at ``rate`` (None: the trace's own timing) on ``seed`` with
    the prefill knob ``knob`` on cluster ``spec``; it may stop once its SLO attainment cannot
    reach ``stop_below`` any more."""

    system: str
    rate: float | None
    seed: int
    knob: Knob
    spec: ClusterSpec
    stop_below: float = 0.0


log = logging.getLogger("tokenlake.progress")

# (args, rate, seed) -> the workload of one run; a module-level function, so that worker
# processes can be handed it
WorkloadFn = Callable[[argparse.Namespace, float | None, int], Workload]


def simulate_key(args: argparse.Namespace, make_workload: WorkloadFn, key: RunKey) -> RunResult:
    """Run one simulation (in whichever process calls it). A run cut by the wall budget is
    re-run with twice the budget, up to ``args.wall_retries`` times: real time never decides
    a verdict. One still cut is returned as it is (stop ``wall_budget``: unresolved)."""
    budget = args.wall_budget
    workload = make_workload(args, key.rate, key.seed)
    for attempt in range(getattr(args, "wall_retries", 0) + 1):
        cfg = RunConfig(
            key.system,
            prefill_tokens=knob_prefill(key.knob),
            mixed_chunk=args.mixed_chunk,
            segment_len=args.segment_len,
            wall_budget_s=budget * 2**attempt,
            horizon_s=args.horizon,
            window_s=args.window,
            eviction=args.eviction,
            seed=key.seed,
            stop_below=key.stop_below,
            page_groups=getattr(args, "page_groups", "on") == "on",
            balance=knob_setting(key.knob).balance,
            split=knob_setting(key.knob).split,
            schedule_policy=knob_setting(key.knob).schedule or FCFS,
            radix_eviction=knob_setting(key.knob).eviction or LRU,
            pricing=pricing_of(args),
            mooncake_store=store_of(args),
            control_plane_cost=control_plane_cost_of(args),
        )
        res = simulate(workload, key.spec, make_timer(key.spec), cfg)
        if res.stop_reason != WALL_BUDGET:
            break
        log.warning(
            "%s at %s req/s (seed %d) was cut by the wall budget of %.0f s%s",
            key.system,
            key.rate,
            key.seed,
            cfg.wall_budget_s,
            "; re-running with twice the budget" if attempt < args.wall_retries else "",
        )
    res.extra["wall_retries"] = attempt
    return res


def _end_with_parent(parent: int) -> None:
    """A worker's initializer: end this process once its parent is gone (killed, or ended by
    a signal before it could shut its pool down), checked every second by a daemon thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="end-with-parent").start()


class Runs:
    """Runs simulations for the harness and reports each one (``report(result, key)``, in
    this process, one at a time). A finished run is kept and handed out again when the same
    key without its early stop is asked for later; a run stopped early is not kept."""

    def __init__(
        self,
        args: argparse.Namespace,
        make_workload: WorkloadFn,
        report: Callable[[RunResult, RunKey], None],
        jobs: int = 1,
        executor: Executor | None = None,
    ) -> None:
        """``jobs > 1`` runs that many at once in worker processes (or on ``executor``, which
        is handed at most ``jobs`` runs at a time)."""
        self.args, self.make_workload, self.report = args, make_workload, report
        self.jobs = jobs
        self._done: dict[tuple, RunResult] = {}
        self._lock = threading.RLock()  # a run's done callback may come in the submitting call
        self._flying: dict[tuple, tuple[float, Future]] = {}  # key[:5] -> (stop_below, run)
        self._reported: set[Future] = set()
        self._waiting: list[tuple[float, int, RunKey, Future]] = []  # heap: rate, order
        self._order = itertools.count()
        self._num_running = 0
        # many() calls waiting, with what they would ask for next: (then, kept, futures)
        self._ahead: dict[int, tuple[Callable, dict, dict]] = {}
        self.num_ahead = 0  # runs started before anyone asked for them
        self._unused_ahead: set[Future] = set()  # ... and not asked for yet
        self._pool = executor
        if executor is None and jobs > 1:
            # spawn: workers start clean (no inherited threads or locks of this process)
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                max_workers=jobs,
                mp_context=ctx,
                initializer=_end_with_parent,
                initargs=(os.getpid(),),
            )

    @property
    def num_waiting(self) -> int:
        """Runs asked for and waiting for a worker."""
        return len(self._waiting)

    def one(self, key: RunKey) -> RunResult:
        return self.many([key])[0]

    def many(
        self,
        keys: Sequence[RunKey],
        then: Callable[[dict[int, RunResult]], Sequence[RunKey]] | None = None,
    ) -> list[RunResult]:
        """Results of ``keys``, run at once on the workers (in order here without any). A key
        already in flight, as a run that stops no later than this one may, is not run twice:
        this call waits for that run (callers in several threads share it). ``then(known)``:
        the keys a caller would ask for next if the runs of ``keys`` not in ``known`` (index
        -> result) pass; while this call waits, an idle worker may start them."""
        out: dict[int, RunResult] = {}
        futures: dict[int, Future] = {}
        for i, key in enumerate(keys):
            with self._lock:
                kept = self._done.get(key[:5])
                flying = self._flying.get(key[:5])
                if kept is None and self._pool is not None:
                    if flying is None or flying[0] > key.stop_below:
                        flying = self._flying[key[:5]] = (key.stop_below, self._queue(key))
                    elif flying[1] in self._unused_ahead:
                        self._unused_ahead.discard(flying[1])
                    futures[i] = flying[1]
            if kept is not None:
                out[i] = kept
            elif self._pool is None:
                out[i] = self._finish(key, simulate_key(self.args, self.make_workload, key))
        token = next(self._order)
        if then is not None and futures:
            with self._lock:
                self._ahead[token] = (then, dict(out), futures)
                self._start_waiting()
        try:
            for i, fut in futures.items():
                out[i] = self._finish(keys[i], fut.result(), fut)
        finally:
            with self._lock:
                self._ahead.pop(token, None)
        return [out[i] for i in range(len(keys))]

    @property
    def num_ahead_used(self) -> int:
        """Runs started ahead that a caller asked for later."""
        return self.num_ahead - len(self._unused_ahead)

    def _queue(self, key: RunKey) -> Future:
        """A future for ``key``'s run, started when a worker is free (lowest rate first)."""
        fut: Future = Future()
        rate = math.inf if key.rate is None else key.rate
        heapq.heappush(self._waiting, (rate, next(self._order), key, fut))
        self._start_waiting()
        return fut

    def _start_waiting(self) -> None:
        with self._lock:
            while self._waiting and self._num_running < self.jobs and self._pool is not None:
                _, _, key, fut = heapq.heappop(self._waiting)
                if not fut.set_running_or_notify_cancel():
                    continue
                self._num_running += 1
                run = self._pool.submit(simulate_key, self.args, self.make_workload, key)
                run.add_done_callback(lambda run, fut=fut: self._ended(run, fut))
            if self._num_running < self.jobs and self._pool is not None:
                key = self._next_ahead()
                if key is not None:  # starts it, and looks for another while workers idle
                    self.num_ahead += 1
                    log.info("an idle worker starts %s at %.4g req/s ahead", key.system, key.rate)
                    fut = self._queue(key)
                    self._unused_ahead.add(fut)
                    self._flying[key[:5]] = (key.stop_below, fut)

    def _next_ahead(self) -> RunKey | None:
        """A run a waiting caller would ask for next if its runs still going pass."""
        for then, kept, futures in self._ahead.values():
            known = dict(kept)
            for i, fut in futures.items():
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    known[i] = fut.result()
            if len(known) == len(kept) + len(futures):
                continue  # all in: the caller asks for its next runs itself
            for key in then(known):
                if key[:5] not in self._done and key[:5] not in self._flying:
                    return key
        return None

    def _ended(self, run: Future, fut: Future) -> None:
        with self._lock:
            self._num_running -= 1
        if run.cancelled():  # the pool shut down under it
            fut.set_exception(CancelledError())
        elif run.exception() is not None:
            fut.set_exception(run.exception())
        else:
            fut.set_result(run.result())
        self._start_waiting()

    def _finish(self, key: RunKey, res: RunResult, fut: Future | None = None) -> RunResult:
        with self._lock:
            if fut is not None:
                if fut in self._reported:  # another caller waited for the same run
                    return res
                self._reported.add(fut)
                if self._flying.get(key[:5], (0, None))[1] is fut:
                    del self._flying[key[:5]]
            self.report(res, key)
            if res.stop_reason != SLO_MISSED:
                self._done[key[:5]] = res
        return res

    def close(self) -> None:
        if self.num_ahead:
            log.info(
                "%d runs were started ahead on idle workers, %d of them asked for",
                self.num_ahead,
                self.num_ahead_used,
            )
        with self._lock:
            pool, self._pool = self._pool, None
            waiting, self._waiting = self._waiting, []
        for *_, fut in waiting:
            fut.cancel()
        if pool is not None:
            # runs still going are not waited for: their workers are ended (a run is long,
            # and close() also runs when the harness is stopped by a signal)
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            pool.shutdown(cancel_futures=True)
