"""One pool shared by N SGLang worker processes: the control service that hosts it.

The control plane (``Pool``: ``gen_plans``, ``commit``, ``abort``, ``finish``, matching) runs
once, in the process that hosts this service (a launcher of its own, or one worker). Every
SGLang worker is one instance of the pool; it asks the service for its forward's plans and
runs them on its own engine clients (:mod:`.shared_runtime`), so a prefix computed on one
worker is attended where it lives from every other worker.

The socket: a ZeroMQ ROUTER bound to loopback (by default), a CURVE server keyed by the
cluster secret (only holders complete the handshake, so nothing an outsider sends is
buffered past one frame), every frame sealed with :class:`FrameAuth` (HMAC, nonce, audience)
and at most ``max_request_bytes``. A request is a msgpack map ``{"op", "seq", ...}``; plans
and chunks travel in the versioned plan wire (:mod:`tokenlake.plan_wire`), decoded and
range-checked against the pool's own geometry. No pickle. One thread serves every request in
arrival order, so the ``Pool`` is only ever touched by that thread.

Which process holds which instance, a dead worker's instance dropped and a worker joining a
dropped instance again: :mod:`.worker_registry`.
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import zmq

from tokenlake import plan_wire, wire
from tokenlake.engines.transport.auth import AuthError, FrameAuth
from tokenlake.engines.transport.peers import bind_random
from tokenlake.errors import InvalidArgumentError, IterationStateError, TokenLakeError
from tokenlake.plans import Chunk, Plans
from tokenlake.pool import Pool

from .attach import attach_info
from .control_ops import OPS, check_request, request_prefix, request_seq
from .worker_registry import WorkerRegistry


class ControlService:
    """Serves ``pool`` to the workers of ``cluster`` (an ``MPCluster`` over the same pool:
    every instance's engines and shared buffers) on a thread of this process."""

    def __init__(
        self,
        pool: Pool,
        cluster,
        host: str = "127.0.0.1",
        max_request_bytes: int = 1 << 26,
        port: int = 0,
    ) -> None:
        """``port``: where to listen (0: any free port; see :attr:`endpoint`)."""
        self.pool, self.cluster = pool, cluster
        cfg = pool.config
        self.limits = plan_wire.PlanLimits(cfg.num_instances, cfg.num_slots, cfg.segment_len)
        self.max_request_bytes = max_request_bytes
        self.stats: Counter = Counter()
        self._auth = FrameAuth(cluster.secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_request_bytes + 4096)
        self._auth.curve_server(self._sock)
        if port:
            self._sock.bind(f"tcp://{host}:{int(port)}")
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.endpoint = bind_random(self._sock, host)
        self._audience = self.endpoint.encode()
        self._plans: dict[int, tuple[Plans, int]] = {}  # epoch -> (plans, worker instance)
        self.workers = WorkerRegistry(pool, cluster, self.stats)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tokenlake-control", daemon=True)
        self._thread.start()

    # ---- the loop --------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            with self._lock:
                try:
                    self.workers.watch(self._abort_plans_of)
                except Exception:  # never die: a drop is tried again at the next wake-up
                    self.stats["internal_errors"] += 1
                if self._sock in ready:
                    self._serve_one()

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            self.stats["malformed_frames"] += 1
            return
        identity, frame = frames
        try:
            body = self._auth.open(frame, self._audience)
        except AuthError:
            self.stats["unauthenticated_frames"] += 1
            return
        seq = -1
        try:
            request = wire.unpackb(body, self.max_request_bytes)
            seq = request_seq(request)  # an error reply still reaches its requester
            op, seq = check_request(request)
            reply = {"seq": seq, "ok": True, "value": getattr(self, f"_op_{op}")(request)}
        except TokenLakeError as e:
            self.stats["rejected_requests"] += 1
            reply = {"seq": seq, "ok": False, "kind": type(e).__name__, "error": str(e)}
        except Exception as e:  # never die of a request: answer it and go on
            self.stats["internal_errors"] += 1
            reply = {"seq": seq, "ok": False, "kind": "TokenLakeError", "error": repr(e)}
        to = FrameAuth.sender_of(frame)
        self._sock.send_multipart([identity, self._auth.seal(wire.packb(reply), to)])

    def snapshot(self) -> dict:
        """The pool's stats (with ``free_capacity``) and the service's counters, taken
        between requests (for ``/metrics``, from any thread)."""
        with self._lock:
            pool = {**self.pool.get_stats(), "free_capacity": self.pool.free_capacity()}
            workers = self.workers
            service = {**self.stats, "workers": len(workers.workers), "lost": sorted(workers.lost)}
            return {"pool": pool, "service": service}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        self._ctx.destroy(linger=0)

    @property
    def lost(self) -> set[int]:
        """Instances dropped because their worker died (until a worker joins one again)."""
        return self.workers.lost

    def _abort_plans_of(self, instance: int) -> None:
        """A worker died: undo what it had in flight."""
        for epoch, (plans, owner) in list(self._plans.items()):
            if owner == instance:
                del self._plans[epoch]
                self.pool.abort(plans, executed=True)

    # ---- operations (one per op name in control_ops.OPS) ----------------------------------
    def _instance(self, request: dict) -> int:
        instance = plan_wire.check_id(
            "instance", request.get("instance"), self.limits.num_instances
        )
        self.workers.check_usable(instance)
        return instance

    def _op_hello(self, r: dict) -> dict:
        instance = self._instance(r)
        self.workers.claim(instance, r.get("pid"))
        cfg = self.pool.config
        return {"num_instances": cfg.num_instances, "num_slots": cfg.num_slots,
                "segment_len": cfg.segment_len, "lost": sorted(self.lost),
                "engine_slots": self.pool.engine_slots,
                "members": self.workers.version}  # fmt: skip

    def _tokens(self, r: dict) -> np.ndarray:
        return plan_wire.check_array("tokens", r.get("tokens")).astype(np.int64)

    def _op_match(self, r: dict) -> int:
        return int(self.pool.get_prefix_tree().match(self._tokens(r)).num_tokens)

    def _pool_id(self, r: dict) -> str:
        pool_id = r.get("pool_id")
        prefix = request_prefix(self._instance(r))
        if not isinstance(pool_id, str) or not pool_id.startswith(prefix):
            raise InvalidArgumentError(
                f"pool_id: expected a str starting {prefix!r}, got {pool_id!r}"
            )
        return pool_id

    def _op_stored(self, r: dict) -> int | None:
        pool_id = self._pool_id(r)
        return self.pool.num_stored_tokens(pool_id) if pool_id in self.pool.requests else None

    def _op_finish(self, r: dict) -> list[int]:
        pool_id = self._pool_id(r)
        if pool_id in self.pool.requests:
            self.pool.finish(pool_id)
        return self._reclaimed(r)

    def _reclaimed(self, r: dict) -> list[int]:
        """Pages the worker gave up that the pool has let go of since (one copy of the KV:
        its SGLang allocator's again); every reply that can free some carries them."""
        return self.pool.reclaim(self._instance(r)) if self.pool.engine_slots else []

    def _op_attach(self, r: dict) -> dict:
        """What a worker the host did not spawn needs to join (named buffers only). A
        dropped instance comes back, empty; one a live worker holds is refused to others."""
        instance = plan_wire.check_id("instance", r.get("instance"), self.limits.num_instances)
        if "pid" in r:
            self.workers.claim(instance, r.get("pid"))
        self.workers.rejoin(instance)
        return {**attach_info(self.cluster), "lost": sorted(self.lost),
                "members": self.workers.version}  # fmt: skip

    def _op_leave(self, r: dict) -> None:
        """The worker gives its instance up (its backend closed)."""
        self.workers.leave(self._instance(r), r.get("pid"), self._abort_plans_of)

    def _op_release(self, r: dict) -> list[int]:
        """The worker's SGLang freed these pages (slots): which it may reuse now."""
        slots = plan_wire.check_array("slots", r.get("slots"))
        return self.pool.release_slots(self._instance(r), slots.tolist())

    def _op_plan(self, r: dict) -> bytes:
        instance = self._instance(r)
        raw = r.get("chunks")
        if not isinstance(raw, list) or not raw:
            raise InvalidArgumentError("chunks: expected a non-empty list of encoded chunks")
        chunks = [plan_wire.decode(c, self.limits, Chunk) for c in raw]
        prefix = request_prefix(instance)
        for c in chunks:
            if not str(c.request_id).startswith(prefix):
                raise InvalidArgumentError(
                    f"chunks: request {c.request_id!r} does not belong to worker {instance}"
                )
        new = {c.request_id for c in chunks if c.request_id not in self.pool.requests}
        engine_slots = None
        if self.pool.engine_slots:
            engine_slots = self._engine_slots(r.get("engine_slots"), chunks)
        plans = self.pool.gen_plans([chunks], dops=[1], instances=[[instance]],
                                    engine_slots=engine_slots)  # fmt: skip
        self._plans[plans.epoch] = (plans, instance)
        self._count_prefix(plans, new)
        # members: the worker re-reads the engines' endpoints when some restarted since
        return {"plans": plan_wire.encode(plans), "members": self.workers.version}

    def _engine_slots(self, raw, chunks: list[Chunk]) -> dict[str, list[int]]:
        """``{request_id: [slot, ...]}`` of a plan request, one list per chunk, in order."""
        if not isinstance(raw, list) or len(raw) != len(chunks):
            raise InvalidArgumentError(
                f"engine_slots: expected a list of {len(chunks)} slot arrays, one per chunk"
            )
        return {
            c.request_id: plan_wire.check_array(f"engine_slots[{i}]", a).tolist()
            for i, (c, a) in enumerate(zip(chunks, raw, strict=True))
        }

    def _count_prefix(self, plans: Plans, new: set) -> None:
        """Prefix tokens attended on the worker's own instance or on another's: every
        forward (``*_prefix_tokens``), and at a request's admission (``*_hit_tokens``: the
        pool's hits, split by where they live)."""
        c = self.pool.config.segment_len
        for qp in plans.query_plans:
            for h, holder in enumerate(qp.holder_ids.tolist()):
                where = "local" if holder == qp.origin else "cross_worker"
                for e in range(int(qp.holder_indptr[h]), int(qp.holder_indptr[h + 1])):
                    pages = int(qp.kv_indptr[e + 1] - qp.kv_indptr[e])
                    n = (pages - 1) * c + int(qp.last_len[e]) if pages else 0
                    self.stats[f"{where}_prefix_tokens"] += n
                    if qp.request_ids[int(qp.entry_req[e])] in new:
                        self.stats[f"{where}_hit_tokens"] += n

    def _epoch(self, r: dict) -> tuple[int, Plans]:
        instance = self._instance(r)
        epoch = r.get("epoch")
        valid = isinstance(epoch, int) and not isinstance(epoch, bool)
        entry = self._plans.get(epoch) if valid else None
        if entry is None or entry[1] != instance:
            raise InvalidArgumentError(f"epoch: {epoch!r} is not in flight for worker {instance}")
        return epoch, entry[0]

    def _op_commit(self, r: dict) -> list[int]:
        epoch, plans = self._epoch(r)
        del self._plans[epoch]
        self.pool.commit(plans)
        return self._reclaimed(r)

    def _op_abort(self, r: dict) -> list[int]:
        epoch, plans = self._epoch(r)
        del self._plans[epoch]
        self.pool.abort(plans, executed=True)
        return self._reclaimed(r)

    def _op_locate(self, r: dict) -> dict:
        """Where tokens ``lo:hi`` of a held prefix live: ``(instance, slot)`` per segment."""
        tokens = self._tokens(r)
        lo, hi = r.get("lo"), r.get("hi")
        match = self.pool.get_prefix_tree().match(tokens[: hi if isinstance(hi, int) else 0])
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not (
            0 <= lo <= hi <= match.num_tokens
        ):
            raise InvalidArgumentError(
                f"lo/hi: expected 0 <= lo <= hi <= {match.num_tokens} held tokens, got {lo}, {hi}"
            )
        nodes = list(match.nodes) + ([match.partial] if match.partial_len else [])
        c = self.pool.config.segment_len
        first, last = lo // c, max(lo, hi - 1) // c + (1 if hi > lo else 0)
        where = [self._replica(nodes[s]) for s in range(first, last)]
        return {"first_segment": first, "where": np.asarray(where, dtype=np.int64).reshape(-1)}

    def _replica(self, node) -> tuple[int, int]:
        for instance, slot in node.replicas:
            if instance not in self.lost:
                return int(instance), int(slot)
        raise IterationStateError("locate: a segment has no replica on a live instance")

    def _op_check(self, r: dict) -> dict:
        """The pool's own invariants (``Pool.check_invariants``: every used slot has exactly
        one owner, pins equal what runs) and its accounting, for tests and operators."""
        self.pool.check_invariants()
        tree = self.pool.get_prefix_tree()
        return {"running": len(self.pool.requests), "in_flight": len(self._plans),
                "slots_used": [a.num_used for a in self.pool.allocators],
                "segments": tree.num_segments, "replicas": tree.num_replicas,
                "last_rejoin_s": self.workers.last_rejoin_s}  # fmt: skip

    def _op_stats(self, r: dict) -> dict:
        s = self.pool.get_stats()
        return {"num_hit_tokens": s["num_hit_tokens"], "hit_rate": float(s["hit_rate"]),
                "num_prompt_tokens": s["num_prompt_tokens"], "lost": sorted(self.lost),
                **{k: int(v) for k, v in self.stats.items()}}  # fmt: skip


assert all(hasattr(ControlService, f"_op_{op}") for op in OPS)
