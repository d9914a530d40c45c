"""The runtime loop: requests in → scheduler step → plans to the compute engine → tokens out.

One thread owns the pool, the scheduler and the engine; clients talk to it only through
:meth:`Runtime.submit` / :meth:`Runtime.cancel` (thread-safe) and the ``sink`` callback each
request carries, which receives :class:`TokenEvent` s on the runtime thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.grammar import GrammarMasks, new_matcher
from tokenlake.engines.model.logits_processors import Pick, pick
from tokenlake.engines.model.sampling import SamplingParams, sample
from tokenlake.errors import InvalidArgumentError, PoolFullError, UnknownRequestError
from tokenlake.scheduler import ElasticScheduler
from tokenlake.serve.membership import Membership
from tokenlake.serve.metrics.requests import RequestMetrics, RequestTimes
from tokenlake.serve.request import GenerationRequest, TokenEvent
from tokenlake.serve.runtime_stats import StatsSnapshots

log = logging.getLogger(__name__)
Sink = Callable[[TokenEvent], None]
Sampler = Callable[[torch.Tensor, SamplingParams, torch.Generator | None], int]


@dataclass(eq=False)
class _Live:
    request: GenerationRequest
    sink: Sink
    generator: torch.Generator | None
    times: RequestTimes  # for the request histograms of /metrics
    num_cached: int = -1  # set at its first chunk
    num_generated: int = 0
    output_ids: list[int] = field(default_factory=list)  # for penalties and min_tokens
    last_pick: Pick | None = None  # this iteration's, with its logprobs if asked for
    matcher: object | None = None  # an xgrammar.GrammarMatcher when the output has a grammar


class Runtime:
    """Serves :class:`GenerationRequest` s with ``engine`` under ``scheduler``.

    ``max_model_len`` bounds prompt + output tokens; ``max_num_seqs`` the requests in the
    scheduler at once (the rest queue here, in arrival order). ``on_close`` callbacks run
    after the loop stopped (releasing engines, temporary files). ``sampler`` picks a token
    from one request's logits; when it raises, that request alone ends with an error.
    """

    def __init__(
        self,
        engine: ModelEngine,
        scheduler: ElasticScheduler,
        max_model_len: int,
        max_num_seqs: int = 64,
        eos_token_ids: tuple[int, ...] = (),
        seed: int = 0,
        on_close: tuple[Callable[[], None], ...] = (),
        sampler: Sampler = sample,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed = seed
        self._on_close = on_close
        self._sampler = sampler
        self._grammar_masks: GrammarMasks | None = None  # made at the first grammar
        self._cond = threading.Condition()
        self._inbox: collections.deque[_Live] = collections.deque()
        self._cancels: set[str] = set()
        self._abort_all = False  # end every request at the loop's next turn (shutdown)
        self._live: dict[str, _Live] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.counters = collections.Counter()
        self.iteration_seconds = 0.0
        self.request_metrics = RequestMetrics(max_model_len)  # read by /metrics' thread
        # what /metrics reads (pool_stats, engine_stats, num_preemptions), taken by the loop
        self.stats = StatsSnapshots(scheduler, getattr(engine.cluster, "engine_stats", None))
        self.membership = Membership(scheduler, engine, self.counters, self._end_all)

    # ---- client side (any thread) ---------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request``; ``sink`` receives its events. Raises ``InvalidArgumentError``
        (nothing queued) for an empty or over-long prompt, a bad token id, a duplicate id."""
        request.check(self.max_model_len, self.engine.model.config.vocab_size)
        generator = None
        if not request.sampling.greedy:
            seed = request.sampling.seed
            if seed is None:
                seed = zlib.crc32(f"{self._seed}:{request.request_id}".encode())
            generator = torch.Generator().manual_seed(seed)
        with self._cond:
            if self._stopping or not self.alive:
                raise RuntimeError("runtime: not running")
            if request.request_id in self._live or any(
                x.request.request_id == request.request_id for x in self._inbox
            ):
                raise InvalidArgumentError(f"request_id: {request.request_id!r} is in use")
            live = _Live(request, sink, generator, self.request_metrics.arrive())
            if request.grammar is not None:
                live.matcher = new_matcher(request.grammar)
            self._inbox.append(live)
            self.counters["requests"] += 1
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """End a request (its client went away): its pins are released before the next
        iteration; its sink gets a final ``abort`` event. Unknown ids are ignored."""
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify()

    def abort_all(self) -> None:
        """End every request, running or queued, with ``abort`` (the server is shutting
        down: each sink still gets its final event). Requests submitted later run."""
        with self._cond:
            self._abort_all = True
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Runtime:
        self._thread = threading.Thread(target=self._loop, name="tokenlake-runtime", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the loop (requests still running end with ``abort``), then release resources."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for callback in self._on_close:
            try:
                callback()
            except Exception:  # keep releasing the rest
                log.exception("runtime: a close callback failed")

    # ---- the loop (runtime thread) --------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                self.stats.refresh()
                self.membership.poll()  # also while idle: a death is seen within the wait below
                with self._cond:
                    if self._stopping:
                        break
                    idle = not (self._inbox or self._cancels or self._abort_all)
                    if idle and not self.scheduler.has_work:
                        self._cond.wait(timeout=0.5)
                        continue
                    cancels, self._cancels = self._cancels, set()
                    if self._abort_all:
                        self._abort_all = False
                        cancels |= set(self._live) | {x.request.request_id for x in self._inbox}
                self._apply_cancels(cancels)
                self._admit()
                if self.scheduler.has_work:
                    self._iterate()
        except BaseException as e:  # never expected: report it, fail everyone
            log.exception("runtime: the loop failed")
            self._error = e
        finally:
            for rid in list(self._live):
                self._end(rid, None, "abort" if self._error is None else "error")
            with self._cond:
                pending, self._inbox = list(self._inbox), collections.deque()
            for live in pending:
                _deliver(live, TokenEvent(live.request.request_id, None, "abort"))

    def _apply_cancels(self, cancels: set[str]) -> None:
        for rid in cancels:
            if rid in self._live:
                self._end(rid, None, "abort")
                continue
            with self._cond:
                found = [x for x in self._inbox if x.request.request_id == rid]
                for x in found:
                    self._inbox.remove(x)
            for x in found:
                _deliver(x, TokenEvent(rid, None, "abort"))

    def _admit(self) -> None:
        while len(self._live) < self.max_num_seqs:
            with self._cond:
                if not self._inbox:
                    return
                live = self._inbox.popleft()
            req = live.request
            self.scheduler.add_request(req.request_id, list(req.prompt_ids), req.max_tokens)
            self._live[req.request_id] = live

    def _iterate(self) -> None:
        t0 = time.perf_counter()
        started_s = self.request_metrics.clock()
        it = self._next_iteration()
        if it is None:
            return
        chunks = {c.request_id: c for c in it.decision.chunks}
        try:
            logits = self.engine.run(it.plans, chunks)
        except Exception as e:
            self._iteration_failed(it, e)
            return
        self._complete(it, logits, started_s)
        self.iteration_seconds += time.perf_counter() - t0

    def _next_iteration(self):
        """The scheduler's next iteration, ``None`` when none starts now; when the running
        requests alone overflow the pool, the newest ends instead."""
        try:
            return self.scheduler.step()
        except PoolFullError as e:
            newest = next(reversed(self._live))
            log.warning("runtime: %s; ending request %s", e, newest)
            self._end(newest, None, "error", f"KV pool full: {e}")
            return None

    def _iteration_failed(self, it, error: Exception) -> None:
        """``it`` failed on the engine: undone; its requests are recomputed if a death
        explains the error, else they end with it."""
        self.scheduler.abort(it)
        self._retire(it.plans)
        if self.membership.after_error(error):  # recomputed on the instances left
            log.warning("runtime: iteration %d: %s", it.plans.epoch, error)
            return
        log.exception("runtime: iteration %d failed", it.plans.epoch, exc_info=error)
        for chunk in it.decision.chunks:
            self._end(chunk.request_id, None, "error", f"engine error: {error}")

    def _complete(self, it, logits: dict, started_s: float) -> None:
        """``it`` ran (``logits``: the next-token rows): sample, commit, stream the tokens."""
        chunks = {c.request_id: c for c in it.decision.chunks}
        tokens, failed = {}, {}
        logits = self._apply_grammars(logits)
        for rid, row in logits.items():
            live = self._live[rid]
            req = live.request
            try:
                live.last_pick = pick(
                    self._sampler, row, req.sampling, live.generator, req.prompt_ids,
                    live.output_ids, req.end_token_ids(self.eos_token_ids),
                )  # fmt: skip
                tokens[rid] = live.last_pick.token_id
            except Exception as e:  # ends this request only (below, once committed)
                log.exception("runtime: sampling for request %s failed", rid)
                failed[rid] = f"sampling error: {e}"
        for rid, chunk in chunks.items():
            live = self._live[rid]
            if live.num_cached < 0:
                live.num_cached = chunk.start
            self.request_metrics.scheduled(live.times, started_s)
        finished = {r.request_id for r in self.scheduler.complete(it, tokens)}
        self._retire(it.plans)
        self.counters["iterations"] += 1
        num_computed = sum(c.num_new_tokens for c in chunks.values())
        self.counters["computed_tokens"] += num_computed
        self.request_metrics.iteration(num_computed)
        for rid, error in failed.items():
            self._end(rid, None, "error", error)
        for rid, token in tokens.items():
            self._emit(rid, token, rid in finished)
        self.stats.after_iteration()

    def _apply_grammars(self, logits: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``logits`` with the rows of requests that have a grammar masked to what their
        matchers allow next: one batched mask for the step."""
        constrained = [rid for rid in logits if self._live[rid].matcher is not None]
        if not constrained:
            return logits
        if self._grammar_masks is None:
            self._grammar_masks = GrammarMasks(self.engine.model.config.vocab_size)
        matchers = [self._live[rid].matcher for rid in constrained]
        masked = self._grammar_masks.apply([logits[rid] for rid in constrained], matchers)
        return {**logits, **{rid: masked[i] for i, rid in enumerate(constrained)}}

    def _retire(self, plans) -> None:
        """Tell the engine the control plane is done with ``plans``; a process that died
        meanwhile is failed over, any other error only logged (the epoch is stale anyway)."""
        try:
            self.engine.retire(plans)
        except Exception as e:
            if not self.membership.after_error(e):
                log.exception("runtime: retiring iteration %d failed", plans.epoch)

    def _end_all(self, error: str) -> None:
        for rid in list(self._live):
            self._end(rid, None, "error", error)

    def _emit(self, rid: str, token: int, finished: bool) -> None:
        live = self._live[rid]
        req = live.request
        live.num_generated += 1
        live.output_ids.append(token)
        chosen = live.last_pick if live.last_pick is not None else Pick(token)
        scores = {"logprob": chosen.logprob, "top_logprobs": chosen.top_logprobs}
        self.counters["generation_tokens"] += 1
        self.request_metrics.token(live.times)
        stop = token in req.stop_token_ids or (not req.ignore_eos and token in self.eos_token_ids)
        if live.matcher is not None:  # the grammar is complete once it accepted its stop token
            if not live.matcher.accept_token(token):
                self._end(rid, token, "error", f"grammar: token {token} was not allowed")
                return
            stop = stop or live.matcher.is_terminated()
        if stop or finished:
            if not finished:
                self.scheduler.cancel(rid)
            del self._live[rid]
            self._count_end(live, "stop" if stop else "length")
            stop_reason = req.stop_reason(token, self.eos_token_ids) if stop else None
            _deliver(
                live,
                TokenEvent(rid, token, "stop" if stop else "length", live.num_cached,
                           stop_reason=stop_reason, **scores),
            )  # fmt: skip
            return
        _deliver(live, TokenEvent(rid, token, None, live.num_cached, **scores))

    def _end(self, rid: str, token: int | None, reason: str, error: str | None = None) -> None:
        live = self._live.pop(rid)
        with contextlib.suppress(InvalidArgumentError, UnknownRequestError):
            self.scheduler.cancel(rid)  # unless it already finished there
        self.stats.pool_changed()
        self._count_end(live, reason)
        _deliver(live, TokenEvent(rid, token, reason, max(live.num_cached, 0), error))

    def _count_end(self, live: _Live, reason: str) -> None:
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += len(live.request.prompt_ids)
        self.counters["cached_prompt_tokens"] += max(live.num_cached, 0)
        self.request_metrics.finished(
            live.times, reason, len(live.request.prompt_ids), live.num_generated
        )


def _deliver(live: _Live, event: TokenEvent) -> None:
    try:
        live.sink(event)
    except Exception:  # a client's sink must not stop the loop
        log.exception("runtime: the sink of request %s failed", event.request_id)
