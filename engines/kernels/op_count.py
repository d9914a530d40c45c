"""Counting what one layer of the attention path asks of the device: torch ops, and host
reads of tensor values (what would stall a GPU's stream).

:class:`OpCounter` is a ``TorchDispatchMode``: every aten op that runs inside it is counted
by name. A host read of a value (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``, and
``torch.equal``, which returns a Python bool) reaches the dispatcher as
``aten._local_scalar_dense`` or ``aten.equal``; a copy to the host (``.cpu()``, ``.to("cpu")``)
as ``aten._to_copy`` / ``aten.copy_`` with a CPU destination from a non-CPU source. On CPU
tensors ``.tolist()`` and ``.numpy()`` read memory without an op (so the CPU kernel's
zero-copy NumPy views are not counted); on CUDA the ``.cpu()`` they need is.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "CudaKernelCounter", "HostReadCounter", "HOST_READ_OPS", "NOT_KERNELS"]

HOST_READ_OPS = ("aten._local_scalar_dense.default", "aten.equal.default")
NOT_KERNELS = (
    "aten.lift_fresh.default",
    "aten.empty.memory_format",
    "aten.new_empty.default",
    "aten._unsafe_view.default",
)
"""Ops that launch no kernel besides views: wrapping host memory, uninitialised allocation, and
``_unsafe_view`` (the view ``reshape`` and ``matmul`` take of a result they just made)."""


def _is_device_to_host(func, args, kwargs, out) -> bool:
    name = str(func)
    if name.startswith("aten._to_copy") or name.startswith("aten.copy_"):
        src = args[1] if name.startswith("aten.copy_") else args[0]
        dst = args[0] if name.startswith("aten.copy_") else out
        return (
            isinstance(src, torch.Tensor)
            and isinstance(dst, torch.Tensor)
            and src.device.type != "cpu"
            and dst.device.type == "cpu"
        )
    return False


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` then ``c.num_ops``, ``c.num_kernels``,
    ``c.num_host_reads``, and ``c.ops`` / ``c.kernels`` (:class:`collections.Counter` by op
    name). The mode is per thread: work another thread does is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()
        self.num_device_to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        self.ops[name] += 1
        if not (getattr(func, "is_view", False) or name in NOT_KERNELS):
            self.kernels[name] += 1
        if _is_device_to_host(func, args, kwargs, out):
            self.num_device_to_host += 1
        return out

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_kernels(self) -> int:
        """Ops that would launch a kernel on a GPU: every op but views (``view``, ``select``,
        ``slice``, ``detach``, ...), which only make a tensor's metadata, and
        :data:`NOT_KERNELS`."""
        return sum(self.kernels.values())

    @property
    def num_host_reads(self) -> int:
        """Scalar reads and ``torch.equal`` calls, plus device → host copies."""
        return sum(self.ops[name] for name in HOST_READ_OPS) + self.num_device_to_host


class CudaKernelCounter:
    """``with CudaKernelCounter() as c: ...`` then ``c.num_kernels``: the kernels launched on
    the GPU inside the block, counted by ``torch.profiler`` (CUPTI), so FlashInfer's (launched
    through tvm-ffi, past torch's dispatcher, where :class:`OpCounter` cannot see them) are
    counted with torch's own; copies and memsets are not kernels. ``c.kernels``: by name.
    NOT RUN ON A GPU."""

    NOT_KERNELS = ("Memcpy", "Memset")

    def __init__(self) -> None:
        self.kernels: Counter[str] = Counter()
        self._profile = None

    def __enter__(self) -> CudaKernelCounter:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self._profile.__exit__(*exc)
        for event in self._profile.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(
                self.NOT_KERNELS
            ):
                self.kernels[event.name] += 1

    @property
    def num_kernels(self) -> int:
        return sum(self.kernels.values())


class HostReadCounter(TorchFunctionMode):
    """``with HostReadCounter() as c: ...`` then ``c.num_reads`` and ``c.reads`` (by method):
    every call that brings a tensor's values to Python or NumPy (``.cpu()``, ``.numpy()``,
    ``.tolist()``, ``.item()``, ``int``/``float``/``bool``/``index`` of a tensor,
    ``np.asarray``), whatever the tensor's device. :class:`OpCounter` sees these only when
    they run an op (on CPU tensors ``.cpu()``, ``.tolist()`` and ``.numpy()`` run none); counted
    here at the Python call, what code run on a CPU machine would read from a GPU's tensors.
    ``.to(device)`` is not counted: it is how host indices are sent to the device."""

    READS = frozenset(
        ("cpu", "numpy", "tolist", "item", "__int__", "__float__", "__bool__", "__index__",
         "__array__")
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def num_reads(self) -> int:
        return sum(self.reads.values())
