"""Per-layer doorbells in shared memory: the query of one layer on a holder of the same host
without a message.

A query plan reaches each holder once per iteration (``BindQuery``). Per layer, the origin
only writes ``(binding, layer)`` and a new sequence number into its slot of the holder's
doorbell area, and the holder answers by writing the sequence number back once its
``(o, lse)`` are in the origin's shared output region: a few stores each way instead of an
authenticated message round trip through two sockets.

One slot per ``(holder, origin)``: a 64-byte line of int64 words (request sequence,
binding, layer, reply sequence, status) and 256 bytes of error text. The origin writes the
request words, the holder the reply words; each side writes its sequence number last. The
processes run on one host and Python issues each store as a separate call, so the x86-64
store order (TSO) publishes the fields before the sequence number. The doorbell area sits in
CPU shared memory also on GPU, where an interprocess CUDA event orders the data itself.

Whatever the holder reads from a slot is hostile until checked: the binding must be one
that origin bound here, the layer inside the model (:class:`QueryEngine` checks both before
touching memory). Waits are bounded: the holder polls with a bounded spin (yielding the
core), then short sleeps, then longer ones, and the origin gives up on a holder whose
process exited or that does not answer within the timeout.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from tokenlake.engines.dataplane_config import PeerFailedError, RemoteEngineError

SLOT_WORDS = 8  # int64 words per slot: one cache line
REQ_SEQ, BINDING, LAYER, REPLY_SEQ, STATUS = range(5)
ERROR_BYTES = 256
OK, FAILED = 1, 2
SLOT_BYTES = SLOT_WORDS * 8 + ERROR_BYTES

# holder side: spin (yielding the core) this long after the last request or bind, then
# sleep briefly until WARM_S, then poll every COLD_SLEEP_S
SPIN_S = 1e-3
WARM_S = 20e-3
WARM_SLEEP_S = 20e-6
COLD_SLEEP_S = 1e-3
# origin side: spin this long, then sleep between polls; check liveness this often
ORIGIN_SPIN_S = 2e-3
ORIGIN_SLEEP_S = 50e-6
LIVENESS_EVERY_S = 5e-3


def supported(machine: str | None = None) -> bool:
    """Whether this host's store order publishes a slot's fields before its sequence number
    (x86-64's TSO); elsewhere the cluster keeps one message per layer."""
    machine = (machine if machine is not None else platform.machine()).lower()
    return machine in ("x86_64", "amd64")


def nbytes(num_instances: int) -> int:
    """Bytes of one instance's doorbell area (one slot per origin)."""
    return num_instances * SLOT_BYTES


class DoorbellArea:
    """Typed views of one holder's doorbell bytes (a CPU ``uint8`` tensor, shared).

    ``words`` is a flat int64 memoryview (slot ``o``'s word ``w`` at ``o * SLOT_WORDS + w``):
    one word read or written costs tens of nanoseconds, a tenth of a numpy scalar access."""

    def __init__(self, raw: torch.Tensor, num_instances: int) -> None:
        if raw.device.type != "cpu" or raw.numel() < nbytes(num_instances):
            raise ValueError(f"raw: need {nbytes(num_instances)} CPU bytes")
        data = raw.numpy()
        words_end = num_instances * SLOT_WORDS * 8
        self.num_instances = num_instances
        self.words = memoryview(data[:words_end]).cast("q")
        self.errors = data[words_end : nbytes(num_instances)].reshape(num_instances, ERROR_BYTES)

    def request_seqs(self) -> list[int]:
        return [self.words[o * SLOT_WORDS + REQ_SEQ] for o in range(self.num_instances)]


class DoorbellClient:
    """The origin side, for every holder on this host: :meth:`ring`, then :meth:`wait`."""

    def __init__(
        self,
        areas: dict[int, DoorbellArea],
        is_alive: Callable[[int], bool],
        timeout_s: float,
    ) -> None:
        self._areas = areas
        self._is_alive = is_alive  # holder instance -> its query engine still runs
        self._timeout_s = timeout_s

    def serves(self, holder: int) -> bool:
        return holder in self._areas

    def ring(self, holder: int, origin: int, binding: int, layer: int) -> tuple[int, int, int]:
        """Ask ``holder`` for its part of ``binding`` at ``layer``; returns the ticket."""
        words, base = self._areas[holder].words, origin * SLOT_WORDS
        seq = words[base + REQ_SEQ] + 1
        words[base + BINDING] = binding
        words[base + LAYER] = layer
        words[base + REQ_SEQ] = seq  # last: publishes the request
        return (holder, origin, seq)

    def wait(self, tickets: list[tuple[int, int, int]], what: str) -> None:
        """Until every holder answered its ticket. Raises :class:`PeerFailedError` when a
        holder's process exited or it did not answer within the timeout, and
        :class:`RemoteEngineError` when it answered with an error."""
        pending = list(tickets)
        start = time.monotonic()
        next_check = start + LIVENESS_EVERY_S
        for _ in range(1 << 62):  # bounded by the deadline below
            pending = [t for t in pending if not self._answered(t)]
            if not pending:
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                for holder, _, _ in pending:
                    if not self._is_alive(holder):
                        raise PeerFailedError(holder, "query", f"process exited during {what}")
                if now - start > self._timeout_s:
                    raise PeerFailedError(
                        pending[0][0], "query", f"no answer to {what} within {self._timeout_s:g} s"
                    )
            if now - start < ORIGIN_SPIN_S:
                os.sched_yield()
            else:
                time.sleep(ORIGIN_SLEEP_S)

    def _answered(self, ticket: tuple[int, int, int]) -> bool:
        holder, origin, seq = ticket
        area = self._areas[holder]
        base = origin * SLOT_WORDS
        if area.words[base + REPLY_SEQ] != seq:
            return False
        if area.words[base + STATUS] != OK:
            text = bytes(area.errors[origin]).split(b"\0", 1)[0].decode("utf-8", "replace")
            raise RemoteEngineError(f"query engine {holder}: {text or 'failed'}")
        return True


class DoorbellServer:
    """The holder side: a thread that serves every origin's doorbell with ``serve(origin,
    binding, layer)`` (which checks its arguments and raises on bad ones) and answers."""

    def __init__(
        self,
        area: DoorbellArea,
        serve: Callable[[int, int, int], None],
        on_error: Callable[[Exception], None],
    ) -> None:
        self._area = area
        self._serve = serve
        self._on_error = on_error
        self._seen = area.request_seqs()
        self._active_at = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="doorbells", daemon=True)
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def rebase(self) -> None:
        """Forget requests rung before now (a new layout: none can be in flight)."""
        with self._lock:
            self._seen = self._area.request_seqs()
            self.wake()

    def wake(self) -> None:
        """A layer request is near (a plan was bound): spin again."""
        self._active_at = time.monotonic()

    def _loop(self) -> None:
        while True:
            try:
                served = self._poll_once()
            except Exception as e:  # never die: the origin times out on what was not answered
                self._on_error(e)
                served = False
            if served:
                self._active_at = time.monotonic()
                continue
            idle = time.monotonic() - self._active_at
            if idle < SPIN_S:
                os.sched_yield()  # also lets the engine's main thread take the GIL
            elif idle < WARM_S:
                time.sleep(WARM_SLEEP_S)
            else:
                time.sleep(COLD_SLEEP_S)

    def _poll_once(self) -> bool:
        served = False
        with self._lock:
            words, seen = self._area.words, self._seen
            for origin in range(self._area.num_instances):
                base = origin * SLOT_WORDS
                seq = words[base + REQ_SEQ]
                if seq == seen[origin]:
                    continue
                seen[origin], served = seq, True
                status = OK
                try:
                    self._serve(origin, words[base + BINDING], words[base + LAYER])
                except Exception as e:  # answered to the origin, which raises it
                    self._on_error(e)
                    status = FAILED
                    text = f"{type(e).__name__}: {e}".encode()[: ERROR_BYTES - 1]
                    self._area.errors[origin, :] = 0
                    self._area.errors[origin, : len(text)] = np.frombuffer(text, np.uint8)
                words[base + STATUS] = status
                words[base + REPLY_SEQ] = seq  # last: publishes the answer
        return served
