"""The plans bound at one instance and the buffers handed out for them, by epoch.

Binding a plan of a newer epoch retires the older ones; :meth:`EpochBindings.retire` retires
an epoch the control plane committed or aborted. A plan or buffer of a retired epoch raises
``StalePlanError``; a buffer this instance never handed out raises ``InvalidArgumentError``.
"""

from __future__ import annotations

import weakref

import torch

from tokenlake.engines.core import executor
from tokenlake.errors import InvalidArgumentError, StalePlanError
from tokenlake.validate import check_tensor

KINDS = ("q", "kv")  # the instance's q buffer (queries) and kv buffer (transfers)


class EpochBindings:
    """Bound plans of the current epoch by buffer kind, keyed by their buffer's ``data_ptr``;
    each bound object has ``plan`` and ``buf`` attributes."""

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self.epoch: int | None = None  # the epoch bound here; older ones are retired
        self._retired: set[int] = set()
        self._bound: dict[str, dict[int, object]] = {k: {} for k in KINDS}
        self._stale: dict[int, weakref.ref] = {}  # buffers handed out in retired epochs
        self._used = dict.fromkeys(KINDS, 0)  # rows handed out in the bound epoch

    def admit(self, name: str, plan, kind: type) -> None:
        """Check ``plan`` (a ``kind`` for this instance, of no retired epoch); a newer epoch
        retires the bound one."""
        executor.check_plan(name, plan, kind, self.instance_id)
        epoch = plan.epoch
        if epoch in self._retired or (self.epoch is not None and epoch < self.epoch):
            raise StalePlanError(
                f"{name}: from iteration {epoch}, which is retired at instance "
                f"{self.instance_id} (bound: {self.epoch})"
            )
        if epoch != self.epoch:
            self._drop()
            self._retired = {e for e in self._retired if e > epoch}
            self.epoch = epoch

    def retire(self, epoch: int) -> None:
        self._retired.add(epoch)
        if epoch == self.epoch:
            self._drop()

    def reserve(self, kind: str, rows: int, name: str, capacity: int) -> int:
        """First row of ``rows`` fresh rows of this instance's ``kind`` buffer."""
        used = self._used[kind]
        if used + max(rows, 1) > capacity:
            raise InvalidArgumentError(
                f"{name}: needs {rows} {kind} rows, but only {capacity - used} of the "
                f"instance's {capacity} (DataPlaneConfig.max_{kind}_rows) are free this iteration"
            )
        self._used[kind] = used + max(rows, 1)  # never two buffers with one data_ptr
        return used

    def add(self, kind: str, bound) -> None:
        self._bound[kind][bound.buf.data_ptr()] = bound

    def lookup(self, kind: str, name: str, buf: object, init: str):
        """The bound plan whose buffer ``buf`` is (argument ``name``, handed out by
        ``init``), checked to be live."""
        table = self._bound[kind]
        if isinstance(buf, torch.Tensor):  # the very view handed out: nothing more to check
            bound = table.get(buf.data_ptr())
            if bound is not None and bound.buf is buf:
                self._check_live(name, bound.plan.epoch)
                return bound
        check_tensor(name, buf)
        ref = self._stale.get(id(buf))
        if ref is not None and ref() is buf:
            raise StalePlanError(f"{name}: a buffer of a retired iteration")
        bound = table.get(buf.data_ptr())
        if bound is None:
            raise InvalidArgumentError(f"{name}: not a buffer returned by this engine's {init}()")
        check_tensor(
            name, buf, shape=tuple(bound.buf.shape), dtype=bound.buf.dtype, device=bound.buf.device
        )
        self._check_live(name, bound.plan.epoch)
        return bound

    def _check_live(self, name: str, epoch: int) -> None:
        if epoch != self.epoch or epoch in self._retired:
            raise StalePlanError(f"{name}: bound in iteration {epoch}, which is retired")

    def _drop(self) -> None:
        self._stale = {k: r for k, r in self._stale.items() if r() is not None}
        for table in self._bound.values():
            for bound in table.values():
                self._stale[id(bound.buf)] = weakref.ref(bound.buf)
        self._bound = {k: {} for k in KINDS}
        self._used = dict.fromkeys(KINDS, 0)
