"""One instance worker's mailbox in shared memory: the server posts an iteration's plans, the
worker answers with its next-token logits, and neither sends a message.

An instance is in at most one iteration at a time (the pool plans over free instances only),
so one job slot and one result slot per worker suffice. The header is a cache line of int64
words; each side writes its payload, then its length, then its sequence number last. Wake-ups
are POSIX semaphores (a futex in shared memory: no system call while nobody sleeps): the
server releases the worker's ``job_ready`` after posting, a worker releases the shared
``results`` semaphore after answering, and the server also releases ``results`` to wake its
own loop (a request arrived). Waits are bounded by their timeouts, so a dead peer is noticed
by the liveness checks around them. Only the server and the workers it spawned hold the
memory (a torch shared tensor, passed as a file descriptor at spawn); whatever the server reads
back is still decoded and checked by its codec (:mod:`tokenlake.wire`).

The processes run on one host; on x86-64 a store becomes visible in program order (TSO),
so the sequence number, written last, publishes the fields before it (as
:mod:`tokenlake.engines.transport.doorbell`); the semaphores order the rest.
"""

from __future__ import annotations

import torch

from tokenlake.errors import InvalidArgumentError

HEADER_BYTES = 64
JOB_SEQ, JOB_LEN, RESULT_SEQ, RESULT_LEN, STATUS, READY_PID = range(6)
OK, FAILED = 1, 2
STOP_LEN = -1  # a job of this length asks the worker to exit


class StepMailbox:
    """The shared header, job and result areas of one worker, with its semaphores.

    Built by :meth:`allocate` in the server; pickled into the worker's spawn arguments
    (the semaphores can only travel then). The server calls :meth:`post`, :meth:`answer_of`
    and :meth:`ready_pid`; the worker :meth:`take`, :meth:`answer` and :meth:`report_ready`.
    """

    def __init__(
        self, raw: torch.Tensor, job_bytes: int, result_bytes: int, job_ready, results
    ) -> None:
        self.raw, self.job_bytes, self.result_bytes = raw, job_bytes, result_bytes
        self.job_ready, self.results = job_ready, results
        data = raw.numpy()
        self._words = memoryview(data[:HEADER_BYTES]).cast("q")
        self._job = data[HEADER_BYTES : HEADER_BYTES + job_bytes]
        self._result = data[HEADER_BYTES + job_bytes : HEADER_BYTES + job_bytes + result_bytes]
        self._seen = self._words[JOB_SEQ]  # worker side: the last job taken

    @classmethod
    def allocate(cls, job_bytes: int, result_bytes: int, ctx, results) -> StepMailbox:
        """A zeroed mailbox in shared memory; ``ctx`` makes the worker's semaphore,
        ``results`` is the semaphore every worker of the server releases."""
        raw = torch.zeros(HEADER_BYTES + job_bytes + result_bytes, dtype=torch.uint8)
        return cls(raw.share_memory_(), job_bytes, result_bytes, ctx.Semaphore(0), results)

    def __reduce__(self):
        args = (self.raw, self.job_bytes, self.result_bytes, self.job_ready, self.results)
        return (StepMailbox, args)

    # ---- server side ---------------------------------------------------------------------
    def post(self, payload: bytes) -> int:
        """Post a job's payload; returns its sequence number. The previous job must have
        been answered (one slot: an instance is in one iteration at a time)."""
        if len(payload) > self.job_bytes:
            raise InvalidArgumentError(
                f"job: {len(payload)} bytes exceed the mailbox's {self.job_bytes} "
                "(more requests or longer sequences than the worker was sized for)"
            )
        self._job[: len(payload)] = memoryview(payload)
        return self._publish(len(payload))

    def post_stop(self) -> None:
        """Ask the worker to exit."""
        self._publish(STOP_LEN)

    def _publish(self, length: int) -> int:
        w = self._words
        seq = w[JOB_SEQ] + 1
        w[JOB_LEN] = length
        w[JOB_SEQ] = seq  # last: publishes the job
        self.job_ready.release()
        return seq

    def answer_of(self, seq: int) -> tuple[int, bytes] | None:
        """``(status, payload)`` once job ``seq`` was answered, else ``None``."""
        w = self._words
        if w[RESULT_SEQ] != seq:
            return None
        n = w[RESULT_LEN]
        if not 0 <= n <= self.result_bytes:
            return FAILED, f"result: a length of {n} bytes".encode()
        return w[STATUS], bytes(self._result[:n])

    def ready_pid(self) -> int:
        """The pid of the worker that reported ready last (0: none yet)."""
        return self._words[READY_PID]

    def reset(self) -> None:
        """Before a fresh worker starts: nothing is pending for it (a job its dead
        predecessor left unanswered is dropped, and its semaphore drained)."""
        self._words[READY_PID] = 0
        while self.job_ready.acquire(block=False):
            pass

    # ---- worker side ---------------------------------------------------------------------
    def report_ready(self, pid: int) -> None:
        self._seen = self._words[JOB_SEQ]  # jobs posted before now were not for this worker
        self._words[READY_PID] = pid
        self.results.release()

    def take(self, timeout_s: float) -> bytes | None:
        """The next job's payload (``None``: none within ``timeout_s``; raises ``StopIteration``
        when asked to stop)."""
        self.job_ready.acquire(timeout=timeout_s)
        w = self._words
        seq = w[JOB_SEQ]
        if seq == self._seen:
            return None
        self._seen = seq
        n = w[JOB_LEN]
        if n == STOP_LEN:
            raise StopIteration
        if not 0 <= n <= self.job_bytes:
            raise InvalidArgumentError(f"job: a length of {n} bytes")
        return bytes(self._job[:n])

    def answer(self, status: int, payload: bytes) -> None:
        """Answer the job taken last with ``payload`` (cut to the result area, as an error)."""
        if len(payload) > self.result_bytes:
            status = FAILED
            payload = f"result: {len(payload)} bytes exceed {self.result_bytes}".encode()
        w = self._words
        self._result[: len(payload)] = memoryview(payload)
        w[RESULT_LEN] = len(payload)
        w[STATUS] = status
        w[RESULT_SEQ] = self._seen  # last: publishes the answer
        self.results.release()
