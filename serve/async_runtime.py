"""The serving loop with asynchronous iterations: each instance steps on its own.

:class:`~tokenlake.serve.runtime.Runtime` runs one iteration at a time and waits for it. Here
the engine computes elsewhere (:class:`~tokenlake.serve.worker_plane.WorkersEngine`: a
worker process per instance), so the loop starts an iteration on every instance that is
free (``scheduler.step()`` until ``None``: the pool keeps iterations in flight over disjoint
instances), then sleeps until some worker answers or a request arrives, completes what
finished (sampling, commit, streaming: the same code as the synchronous loop) and plans
again for the instances that just freed up. A slow prefill on one instance no longer holds
back the decode steps of another.

A worker that dies is seen within one wait (``WAIT_S``) of the loop: no new iteration
starts, the iterations in flight on the other instances finish (they may read or write the
dead instance's segments, whose memory the server still holds), then the dead ones are
aborted and the instance is failed over (:class:`~tokenlake.serve.membership.Membership`),
its requests recomputed on the others. A request cancelled while in flight ends when its
iteration does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.scheduler.planned import IterationPlan
from tokenlake.serve.runtime import Runtime

log = logging.getLogger(__name__)
# longest sleep of the loop between looks at the workers (a death is seen within it)
WAIT_S = 0.05


@dataclass(eq=False)
class _InFlight:
    it: IterationPlan
    ticket: object
    began: float  # perf_counter
    started_s: float  # the request metrics' clock
    dead: bool = False  # its worker died: aborted once the others drained


class AsyncRuntime(Runtime):
    """A :class:`Runtime` over an engine that runs iterations in the background: ``start(plans,
    chunks)`` → ticket, ``answer(ticket, request_ids)`` → logits or ``None``, ``wait(s)``,
    ``wake()``, ``dead()`` (see :class:`~tokenlake.serve.worker_plane.WorkersEngine`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._flying: dict[int, _InFlight] = {}  # epoch -> iteration in flight
        self._deferred: dict[str, tuple] = {}  # request id -> its _end, once not in flight
        self._dying: set[int] = set()  # instances whose worker died, not failed over yet

    def submit(self, request, sink) -> None:
        super().submit(request, sink)
        self.engine.wake()

    def cancel(self, request_id: str) -> None:
        super().cancel(request_id)
        self.engine.wake()

    def close(self) -> None:
        self.engine.wake()
        super().close()

    # ---- the loop (runtime thread) --------------------------------------------------------
    def _iterate(self) -> None:
        self._start_free()
        self.engine.wait(WAIT_S)  # ends early at an answer, a request or a cancel
        self._collect()
        self._fail_over_drained()

    def _start_free(self) -> None:
        """An iteration for every free instance (none while a death is being handled)."""
        while not self._dying:
            began, started_s = time.perf_counter(), self.request_metrics.clock()
            it = self._next_iteration()
            if it is None:
                return
            chunks = {c.request_id: c for c in it.decision.chunks}
            try:
                ticket = self.engine.start(it.plans, chunks)
            except PeerFailedError as e:  # its worker is gone: retried after the fail-over
                self.scheduler.abort(it)
                self._dying.add(e.instance_id)
                return
            except Exception as e:
                self._iteration_failed(it, e)
                continue
            self._flying[it.plans.epoch] = _InFlight(it, ticket, began, started_s)

    def _collect(self) -> None:
        for epoch, f in list(self._flying.items()):
            if f.dead:
                continue
            try:
                logits = self.engine.answer(f.ticket, [c.request_id for c in f.it.decision.chunks])
            except PeerFailedError as e:
                log.warning("runtime: iteration %d: %s", epoch, e)
                f.dead = True
                self._dying.add(e.instance_id)
                continue
            except Exception as e:
                del self._flying[epoch]
                self._iteration_failed(f.it, e)
                continue
            if logits is None:
                continue
            del self._flying[epoch]
            self._complete(f.it, logits, f.started_s)
            self.iteration_seconds += time.perf_counter() - f.began
        self._dying.update(self.engine.dead())
        for rid in [r for r in self._deferred if r not in self._in_flight_requests()]:
            args = self._deferred.pop(rid)
            if rid in self._live:
                super()._end(rid, *args)

    def _fail_over_drained(self) -> None:
        """Once only dead workers' iterations are in flight: abort them and fail over."""
        if not self._dying or any(not f.dead for f in self._flying.values()):
            return
        for epoch, f in list(self._flying.items()):
            del self._flying[epoch]
            self.scheduler.abort(f.it)
        for instance_id in sorted(self._dying):
            try:
                self.membership.fail_over(instance_id)
            except Exception:
                log.exception("runtime: failing over instance %d failed", instance_id)
        self._dying.clear()

    def _in_flight_requests(self) -> set:
        return {c.request_id for f in self._flying.values() for c in f.it.decision.chunks}

    def _end(self, rid: str, token, reason: str, error: str | None = None) -> None:
        # a request in an iteration in flight ends when that iteration is done (its state
        # is the scheduler's until then); at shut-down, at once
        if not self._stopping and self._error is None and rid in self._in_flight_requests():
            self._deferred[rid] = (token, reason, error)
            return
        super()._end(rid, token, reason, error)
