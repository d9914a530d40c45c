"""The pool and its data plane as the SGLang backend uses them: the one module of the backend
that touches the control plane's iteration API and the data plane's engine calls.

One SGLang forward is one pool iteration: ``begin`` plans it (one batch, DoP 1) and binds
the buffers, every layer ``put``s then ``query``s, ``commit`` seals it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.config import KERNEL_DTYPES, ModelShape, PoolConfig
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.errors import InvalidArgumentError, IterationStateError
from tokenlake.plans import Chunk, Plans, QueryPlan
from tokenlake.pool import Pool

from .config import SGLangPoolConfig
from .model_check import UnsupportedFeatureError


@dataclass(eq=False)
class BoundIteration:
    """One planned iteration with its bound buffers.

    ``q_buf`` ``[num_rows, H_q, D]`` and ``kv_buf`` ``[num_layers, num_rows, 2, H_kv, D]``
    hold the plan's rows request by request (``query_plan.q_indptr``), in pool dtype.
    """

    plans: Plans
    query_plan: QueryPlan
    q_buf: torch.Tensor
    kv_buf: torch.Tensor
    engine: object


def pool_config_for(
    config: SGLangPoolConfig, shape: ModelShape, namespace: str, device: torch.device | str
) -> PoolConfig:
    """The pool's config for SGLang's KV ``shape`` on SGLang's ``device``: the kernels of that
    device decide which dtypes the pool accepts (float16 on CUDA, not on the CPU kernels)."""
    kind = torch.device(device).type
    if shape.dtype not in KERNEL_DTYPES.get(kind, ()):
        raise UnsupportedFeatureError(
            f"--attention-backend tokenlake does not support a {shape.dtype} KV cache on "
            f"{kind}: the pool's {kind} kernels take {KERNEL_DTYPES.get(kind, ())}"
        )
    return PoolConfig(
        shape, config.num_instances, config.num_slots, config.segment_len, namespace, kind
    )


class PoolRuntime:
    """A :class:`tokenlake.Pool` of ``config.num_instances`` instances with an in-process
    data plane on ``device``."""

    def __init__(
        self,
        config: SGLangPoolConfig,
        shape: ModelShape,
        namespace: str,
        device: torch.device | str = "cpu",
    ) -> None:
        pool_config = pool_config_for(config, shape, namespace, device)
        self.config = config
        self.model = shape
        self.request_prefix = ""  # one process: no other worker's ids to keep apart
        self.engine_slots = False  # a pool beside SGLang's cache (one copy: shared_runtime)
        self.segment_len = config.segment_len
        self.pool = Pool(pool_config)
        rows = config.max_forward_rows
        self.max_rows = rows
        self.cluster = LocalCluster(
            pool_config, device=device, backend=config.kernel_backend,
            dataplane=DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows),
        )  # fmt: skip
        self.kernel_backend = config.kernel_backend
        self._inflight: BoundIteration | None = None

    # ---- requests --------------------------------------------------------------------
    def match_len(self, token_ids: np.ndarray) -> int:
        """Tokens of ``token_ids`` whose KV the pool holds (sealed segments, partial tails)."""
        return self.pool.get_prefix_tree().match(token_ids).num_tokens

    def stored_len(self, pool_id: str) -> int | None:
        """Tokens stored for a running pool request, ``None`` if it is not running."""
        if pool_id not in self.pool.requests:
            return None
        return self.pool.num_stored_tokens(pool_id)

    def read_kv(self, token_ids: np.ndarray, lo: int, hi: int) -> torch.Tensor:
        """K and V of tokens ``lo:hi`` of a prefix the pool holds (``match_len(token_ids) >=
        hi``), read from the in-process instances' slots: ``[num_layers, hi - lo, 2, H_kv,
        D]`` in pool dtype. No iteration may be in flight (its puts could still move data)."""
        if self._inflight is not None:
            raise IterationStateError("read_kv: an SGLang forward is in flight")
        match = self.pool.get_prefix_tree().match(token_ids[:hi])
        if not 0 <= lo <= hi <= match.num_tokens:
            raise InvalidArgumentError(
                f"lo/hi: expected 0 <= lo <= hi <= {match.num_tokens} cached tokens, got {lo}, {hi}"
            )
        nodes = list(match.nodes) + ([match.partial] if match.partial_len else [])
        seg, offset = np.divmod(np.arange(lo, hi), self.config.segment_len)
        where = np.array([nodes[s].replicas[0] for s in seg.tolist()], dtype=np.int64)
        where = where.reshape(-1, 2)  # (instance_id, slot_id) per token
        shape = self.pool.config.model
        out = torch.empty(
            (shape.num_layers, hi - lo, 2, shape.num_kv_heads, shape.head_dim),
            dtype=shape.torch_dtype,
            device=self.cluster.kv_pools[0].data.device,
        )
        for instance in np.unique(where[:, 0]).tolist():
            rows = np.flatnonzero(where[:, 0] == instance)
            data = self.cluster.kv_pools[instance].data  # [L, S, 2, C, H_kv, D]
            slot = torch.from_numpy(where[rows, 1]).to(data.device)
            off = torch.from_numpy(offset[rows]).to(data.device)
            out[:, torch.from_numpy(rows).to(data.device)] = data[:, slot, :, off].transpose(0, 1)
        return out

    def finish(self, pool_id: str) -> None:
        """Release a request's pins; its partial tail stays for a later turn."""
        if pool_id in self.pool.requests:
            self.pool.finish(pool_id)

    # ---- one iteration ---------------------------------------------------------------
    @property
    def inflight(self) -> BoundIteration | None:
        return self._inflight

    def begin(self, chunks: list[Chunk]) -> BoundIteration:
        """Plan one forward's chunks as one batch and bind its buffers."""
        if self._inflight is not None:
            raise IterationStateError("an SGLang forward is still in flight; commit or abort it")
        plans = self.pool.gen_plans([chunks], dops=[1])
        try:
            (qp,), (tp,) = plans.query_plans, plans.transfer_plans
            engine = self.cluster.engine(qp.origin)
            q_buf = engine.init_query(qp)
            kv_buf = engine.init_transfer(tp)
        except BaseException:
            self.pool.abort(plans)  # copies of init_transfer may have run
            self.cluster.retire(plans.epoch)
            raise
        self._inflight = BoundIteration(plans, qp, q_buf, kv_buf, engine)
        return self._inflight

    def put(self, it: BoundIteration, layer: int) -> None:
        it.engine.put(it.kv_buf, layer)

    def query(self, it: BoundIteration, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix attention of ``it.q_buf``: ``o`` ``[rows, H_q, D]``, ``lse`` ``[rows, H_q]``
        float32, natural log."""
        return it.engine.query(it.q_buf, layer)

    def commit(self) -> None:
        """Seal the iteration once every put landed."""
        if self._inflight is not None:
            it, self._inflight = self._inflight, None
            it.engine.synchronize()
            self.pool.commit(it.plans)
            self.cluster.retire(it.plans.epoch)

    def abort(self) -> None:
        """Undo the iteration (a forward that failed part-way: its puts may have run)."""
        if self._inflight is not None:
            it, self._inflight = self._inflight, None
            self.pool.abort(it.plans, executed=True)
            self.cluster.retire(it.plans.epoch)
