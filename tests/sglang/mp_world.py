"""Worker processes of one shared pool, for the cross-process tests.

Each worker process is one instance of the pool: a real SGLang world (``sgl_world.World``:
``ReqToTokenPool``, ``MHATokenToKVPool``, ``RadixAttention``, ``ForwardBatch``, the
``torch_native`` reference) whose TokenLake backend drives a ``SharedPoolRuntime``. The test
process hosts the control plane (``Pool``, the engines' ``MPCluster``, the
``ControlService``) and drives the workers over pipes carrying msgpack (no pickle).
"""

from __future__ import annotations

import contextlib
import os

import torchvision_stub  # noqa: F401  (before any sglang import, also in a worker process)

from tokenlake import wire

_MAX = 1 << 24
IDLE_EXIT_S = 300  # a worker whose test is gone ends by itself


def worker_main(attach, conn, world_kwargs: dict) -> None:
    """A worker process (spawn target): build the world, then answer the test's requests."""
    import numpy as np
    import sgl_world
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from tokenlake.engines.sglang.config import SGLangPoolConfig
    from tokenlake.engines.sglang.shared_runtime import SharedPoolRuntime

    torch.set_num_threads(1)
    if isinstance(attach, dict):  # a separate worker: it knows the endpoint, secret and id
        runtime = SharedPoolRuntime.join(attach["endpoint"], attach["secret_path"],
                                         attach["instance_id"])  # fmt: skip
    else:
        runtime = SharedPoolRuntime(attach)
    pool_data = runtime.instance_pool_data  # [L, S, 2, C, H_kv, D]
    one_copy = runtime.engine_slots
    if one_copy:  # SGLang's KV cache is this instance's slots, and its allocator pages them
        from tokenlake.engines.sglang.one_copy import SlotKVPool, SlotPageAllocator

        kv_pool = SlotKVPool(pool_data, device="cpu", enable_memory_saver=False)
        world_kwargs = {**world_kwargs, "kv_pool": kv_pool}
    world = sgl_world.World(SGLangPoolConfig(), runtime=runtime, **world_kwargs)
    if one_copy:
        world.allocator = SlotPageAllocator(
            pool_data.shape[1], pool_data.shape[3], kv_pool, runtime.release_slots,
            runtime.reclaimed,
        )  # fmt: skip
    modes = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE,
             "mixed": ForwardMode.MIXED, None: None}  # fmt: skip

    def load_add(rid: str, tokens: list[int]) -> int:
        """A new request whose prefix only the pool holds, as SGLang's radix cache
        (``TokenLakeRadixCache``) admits it: the held prefix is loaded into this worker's
        SGLang cache, then reused (not recomputed)."""
        ids = np.asarray(tokens, dtype=np.int32)
        n = min(runtime.match_len(ids), len(tokens) - 1)
        slots = world.alloc_locs(0, n, None)
        if n:
            world.tokenlake.load_prefix(ids, 0, n, torch.tensor(slots))
        world.add(rid, tokens, prefix_slots=slots)
        return n

    def kv_storage() -> dict:
        kv = world.runner.token_to_kv_pool
        out = {"sglang_bytes": int(sum(b.nbytes for b in kv.k_buffer + kv.v_buffer)),
               "instance_bytes": int(pool_data.nbytes)}  # fmt: skip
        if one_copy:
            out["same_storage"] = kv.shares_storage_with(pool_data)
            out["k_ptrs"] = [int(b.data_ptr() - pool_data.data_ptr()) for b in kv.k_buffer]
            out["v_ptrs"] = [int(b.data_ptr() - pool_data.data_ptr()) for b in kv.v_buffer]
            out["available_tokens"] = int(world.allocator.available_size())
        return out

    handlers = {
        "add": lambda m: (
            world.add(m["rid"], m["tokens"], m.get("share_from"), m.get("share", 0)) and None
        ),  # fmt: skip
        "load_add": lambda m: load_add(m["rid"], m["tokens"]),
        "step": lambda m: world.step(m["work"], modes[m.get("mode")]),
        "release": lambda m: world.release(m["rid"]),
        "tokens": lambda m: world.reqs[m["rid"]].tokens[: world.reqs[m["rid"]].num_cached],
        "stats": lambda m: runtime.stats(),
        "kv_storage": lambda m: kv_storage(),
        "max_err": lambda m: world.max_err,
        "num_local_forwards": lambda m: world.tokenlake.num_local_forwards,
    }
    conn.send_bytes(wire.packb({"ok": True, "value": os.getpid()}))
    while conn.poll(IDLE_EXIT_S):
        try:
            msg = wire.unpackb(conn.recv_bytes(), _MAX)
        except EOFError:
            break
        if msg.get("op") == "stop":
            break
        try:
            reply = {"ok": True, "value": handlers[msg["op"]](msg)}
        except Exception as e:  # the test reads it; the worker goes on
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        conn.send_bytes(wire.packb(reply))
    runtime.close()
    os._exit(0)


class Workers:
    """The test's side: spawns one worker per instance of ``cluster`` and calls them."""

    def __init__(
        self, cluster, service, world_kwargs: dict, timeout_s: float = 300.0, join: bool = False
    ) -> None:
        """``join``: each worker gets only strings (the service's endpoint, the secret's file,
        its instance id) and joins by name, as a separate SGLang server would. ``timeout_s``
        bounds each answer: a worker's start imports SGLang, which took over 60 s on a busy
        2-core machine."""
        from tokenlake.engines.clusters.launcher import Started, process_context
        from tokenlake.engines.sglang.attach import WorkerAttachment

        ctx = process_context()
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for i in range(cluster.layout.num_instances):
            if join:
                attach = {"endpoint": service.endpoint, "secret_path": cluster.secret_path,
                          "instance_id": i}  # fmt: skip
            else:
                attach = WorkerAttachment(
                    i, service.endpoint, cluster.secret_path, cluster.config, cluster.layout,
                    cluster.backend, tuple(cluster.buffers), cluster.endpoints,
                )  # fmt: skip
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(attach, child, world_kwargs), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(Started(p))
        self.pids = [self._reply(i) for i in range(len(self.conns))]  # ready, or an error

    def call(self, i: int, op: str, **args):
        self.conns[i].send_bytes(wire.packb({"op": op, **args}))
        return self._reply(i)

    def _reply(self, i: int):
        if not self.conns[i].poll(self.timeout_s):
            raise TimeoutError(f"worker {i}: no answer in {self.timeout_s} s")
        reply = wire.unpackb(self.conns[i].recv_bytes(), _MAX)
        if not reply["ok"]:
            raise AssertionError(f"worker {i}: {reply['error']}")
        return reply["value"]

    def kill(self, i: int) -> None:
        self.procs[i].kill()

    def close(self) -> None:
        from tokenlake.engines.clusters.launcher import stop_processes

        for i, conn in enumerate(self.conns):
            if self.procs[i].alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(wire.packb({"op": "stop"}))
        stop_processes(self.procs, 5.0)


@contextlib.contextmanager
def shared_pool(
    world: dict, num_workers: int, num_slots: int, segment_len: int, one_copy: bool = False,
    join: bool = False,
):  # fmt: skip
    """The host (this process: ``Pool``, the engines' ``MPCluster``, the ``ControlService``)
    and ``num_workers`` worker processes of one SGLang ``world`` shape; ``one_copy``: the
    pool takes SGLang's pages as its slots; ``join``: the buffers are named and each worker
    joins knowing only the endpoint, the secret's file and its instance id. Yields
    ``(pool, cluster, service, workers)``; stops everything on the way out."""
    from tokenlake.config import ModelShape, PoolConfig
    from tokenlake.engines.clusters.mp import MPCluster
    from tokenlake.engines.dataplane_config import DataPlaneConfig
    from tokenlake.engines.sglang.control_service import ControlService
    from tokenlake.pool import Pool

    shape = ModelShape(world["num_layers"], world["num_q_heads"], world["num_kv_heads"],
                       world["head_dim"], "float32")  # fmt: skip
    config = PoolConfig(shape, num_workers, num_slots, segment_len, "tiny-test-model")
    pool = Pool(config, engine_slots=one_copy)
    dataplane = DataPlaneConfig(max_q_rows=256, max_kv_rows=256, kernel_threads=1)
    cluster = MPCluster(pool, dataplane, named_buffers=join)
    service = workers = None
    try:
        service = ControlService(pool, cluster)
        workers = Workers(cluster, service, world, join=join)
        yield pool, cluster, service, workers
    finally:
        if service is not None:
            service.close()
        if workers is not None:
            workers.close()
        cluster.close()


def wait_lost(service, instance: int, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the control service has dropped a killed worker's instance."""
    import time

    deadline = time.monotonic() + timeout_s
    while instance not in service.lost and time.monotonic() < deadline:
        time.sleep(0.05)


def metric_sample(text: str, name: str) -> float:
    """The value of the one sample ``name`` in Prometheus text ``text``."""
    (line,) = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])
