"""One instance's shared buffers: allocated once as raw bytes, laid out per pool.

The launcher allocates the storage (``share_memory_()`` on CPU; CUDA memory that
``torch.multiprocessing`` hands to children as CUDA IPC handles) and passes it to the
instance's engines at spawn time. Every process then builds the same typed views from a
:class:`Layout`, so a cluster can be re-laid for another pool without relaunching as long as
the new layout fits the bytes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from tokenlake.config import ModelShape
from tokenlake.engines.core.kv_pool import KVPool
from tokenlake.errors import InvalidArgumentError

_ALIGN = 64  # bytes; keeps every typed view aligned for any dtype and SIMD loads


class _Segment(SharedMemory):
    """A named shared memory segment that is never unmapped by garbage collection: the
    buffers' tensors point into the mapping, and a view may outlive every Python object of
    the segment; the mapping goes with the process (the host unlinks the name)."""

    def __del__(self) -> None:
        pass


@dataclass(frozen=True)
class Layout:
    """Shapes of one instance's buffers for a pool of ``num_instances`` instances."""

    model: ModelShape
    num_instances: int
    num_slots: int
    segment_len: int
    max_q_rows: int
    max_kv_rows: int

    @property
    def pool_shape(self) -> tuple[int, ...]:
        m = self.model
        return (m.num_layers, self.num_slots, 2, self.segment_len, m.num_kv_heads, m.head_dim)

    @property
    def q_shape(self) -> tuple[int, ...]:
        return (self.max_q_rows, self.model.num_q_heads, self.model.head_dim)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        m = self.model
        return (m.num_layers, self.max_kv_rows, 2, m.num_kv_heads, m.head_dim)

    @property
    def out_o_shape(self) -> tuple[int, ...]:
        """One region per holder instance: ``[N, max_q_rows, H_q, D]`` float32."""
        return (self.num_instances, self.max_q_rows, self.model.num_q_heads, self.model.head_dim)

    @property
    def out_lse_shape(self) -> tuple[int, ...]:
        return (self.num_instances, self.max_q_rows, self.model.num_q_heads)

    def nbytes(self) -> dict[str, int]:
        """Bytes each buffer needs, by name."""
        item = self.model.dtype_bytes
        sizes = {
            "pool": _numel(self.pool_shape) * item,
            "q": _numel(self.q_shape) * item,
            "kv": _numel(self.kv_shape) * item,
            "out_o": _numel(self.out_o_shape) * 4,
            "out_lse": _numel(self.out_lse_shape) * 4,
        }
        return {k: -(-v // _ALIGN) * _ALIGN for k, v in sizes.items()}


@dataclass(frozen=True)
class InstanceViews:
    """Typed views of one instance's shared buffers.

    ``pool`` is the slot storage ``[L, S, 2, C, H_kv, D]``; ``q`` ``[max_q_rows, H_q, D]``
    and ``kv`` ``[L, max_kv_rows, 2, H_kv, D]`` are in the model dtype; ``out_o``
    ``[N, max_q_rows, H_q, D]`` and ``out_lse`` ``[N, max_q_rows, H_q]`` are float32, region
    ``h`` written by holder instance ``h``.
    """

    pool: KVPool
    q: torch.Tensor
    kv: torch.Tensor
    out_o: torch.Tensor
    out_lse: torch.Tensor


class InstanceBuffers:
    """The raw shared storage of one instance: one ``uint8`` tensor per buffer, and the
    instance's doorbell area (:mod:`tokenlake.engines.transport.doorbell`; CPU shared memory on every
    device, ``None`` where the engines are reached by messages only).

    ``named`` buffers (CPU) live in POSIX shared memory segments with names, so a process
    the launcher did not spawn (an SGLang worker joining a running host) can map them by
    name (:meth:`attach`); pickled for a spawned process they travel as their names."""

    NAMES = ("pool", "q", "kv", "out_o", "out_lse")

    def __init__(
        self,
        raw: dict[str, torch.Tensor],
        doorbells: torch.Tensor | None = None,
        segments: dict[str, SharedMemory] | None = None,
        owner: bool = False,
    ) -> None:
        self.raw = raw
        self.doorbells = doorbells
        self._segments = segments  # name -> its shared memory segment (named buffers)
        self._owner = owner

    @property
    def segment_names(self) -> dict[str, str] | None:
        """Buffer name -> shared memory segment name (``None`` unless named)."""
        if self._segments is None:
            return None
        return {k: seg.name for k, seg in self._segments.items()}

    def sizes(self) -> dict[str, int]:
        out = {k: int(t.numel()) for k, t in self.raw.items()}
        if self.doorbells is not None:
            out["doorbells"] = int(self.doorbells.numel())
        return out

    @classmethod
    def create_named(cls, nbytes: dict[str, int], doorbell_bytes: int = 0) -> InstanceBuffers:
        """CPU buffers in new named shared memory segments, zeroed (removed by :meth:`unlink`)."""
        sizes = {name: nbytes[name] for name in cls.NAMES}
        if doorbell_bytes > 0:
            sizes["doorbells"] = doorbell_bytes
        segments = {k: _Segment(create=True, size=max(1, n)) for k, n in sizes.items()}
        return cls._over(segments, sizes, owner=True)

    @classmethod
    def attach(cls, names: dict[str, str], sizes: dict[str, int]) -> InstanceBuffers:
        """Map the named buffers of a running host (CPU). Only the creator removes them."""
        if set(names) != set(sizes) or not set(cls.NAMES) <= set(names):
            raise InvalidArgumentError(
                f"names: expected segments for {list(cls.NAMES)} (and doorbells), got {sorted(names)}"
            )
        segments = {}
        for k, name in names.items():
            try:
                seg = _Segment(name=str(name))
            except FileNotFoundError:
                raise InvalidArgumentError(
                    f"names[{k!r}]: no shared memory segment {name!r} (is the host running?)"
                ) from None
            # attaching registers the segment with this process's resource tracker, which
            # would remove it when this process exits; it is the host's to remove
            resource_tracker.unregister(seg._name, "shared_memory")
            if seg.size < int(sizes[k]):
                raise InvalidArgumentError(
                    f"sizes[{k!r}]: segment {name!r} has {seg.size} bytes, expected {sizes[k]}"
                )
            segments[k] = seg
        return cls._over(segments, sizes, owner=False)

    @classmethod
    def _over(cls, segments: dict, sizes: dict[str, int], owner: bool) -> InstanceBuffers:
        tensors = {
            k: torch.frombuffer(seg.buf, dtype=torch.uint8, count=sizes[k]) if sizes[k] else
            torch.zeros(0, dtype=torch.uint8)
            for k, seg in segments.items()
        }  # fmt: skip
        doorbells = tensors.pop("doorbells", None)
        return cls(tensors, doorbells, segments, owner)

    def __reduce__(self):
        if self._segments is None:  # torch shares the tensors (file descriptors, CUDA IPC)
            return (InstanceBuffers, (self.raw, self.doorbells))
        return (InstanceBuffers.attach, (self.segment_names, self.sizes()))

    def unlink(self) -> None:
        """The creator removes its named segments (mapped ones stay valid until unmapped)."""
        if self._segments is not None and self._owner:
            for seg in self._segments.values():
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()
            self._owner = False

    @classmethod
    def allocate(
        cls, nbytes: dict[str, int], device, shared: bool = True, doorbell_bytes: int = 0
    ) -> InstanceBuffers:
        """Storage of ``nbytes[name]`` bytes per buffer, shareable across processes when
        ``shared``, plus ``doorbell_bytes`` of zeroed CPU shared memory (if any). The pool
        is zeroed; unshared staging buffers are left to the OS to map on first touch (every
        row is written before it is read)."""
        raw = {}
        for name in cls.NAMES:
            make = torch.zeros if shared or name == "pool" else torch.empty
            t = make(nbytes[name], dtype=torch.uint8, device=device)
            raw[name] = t.share_memory_() if shared and t.device.type == "cpu" else t
        doorbells = None
        if shared and doorbell_bytes > 0:
            doorbells = torch.zeros(doorbell_bytes, dtype=torch.uint8).share_memory_()
        return cls(raw, doorbells)

    def fits(self, layout: Layout) -> str | None:
        """``None`` if ``layout`` fits, else which buffer is too small and by how much."""
        for name, need in layout.nbytes().items():
            have = self.raw[name].numel()
            if need > have:
                return f"{name} buffer needs {need} bytes, the cluster has {have}"
        return None

    def views(self, layout: Layout) -> InstanceViews:
        problem = self.fits(layout)
        if problem is not None:
            raise InvalidArgumentError(f"layout: {problem}")
        m = layout.model

        def typed(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            return self.raw[name][:n].view(dtype).view(shape)

        pool_data = typed("pool", layout.pool_shape, m.torch_dtype)
        return InstanceViews(
            pool=KVPool(m, layout.num_slots, layout.segment_len, data=pool_data),
            q=typed("q", layout.q_shape, m.torch_dtype),
            kv=typed("kv", layout.kv_shape, m.torch_dtype),
            out_o=typed("out_o", layout.out_o_shape, torch.float32),
            out_lse=typed("out_lse", layout.out_lse_shape, torch.float32),
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
