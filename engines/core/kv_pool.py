"""One instance's slot storage: every layer's ``[num_slots, 2, C, H_kv, D]`` pages in one tensor."""

from __future__ import annotations

import functools

import torch

from tokenlake.config import ModelShape


class KVPool:
    """``data`` is ``[num_layers, num_slots, 2, C, H_kv, D]``; ``[:, :, 0]`` is K, ``[:, :, 1]`` V.

    One contiguous tensor so it can be shared across processes in one piece
    (``share_memory_()`` on CPU, CUDA IPC on GPU).
    """

    def __init__(
        self,
        model: ModelShape,
        num_slots: int,
        segment_len: int,
        device: torch.device | str = "cpu",
        data: torch.Tensor | None = None,
    ) -> None:
        shape = (model.num_layers, num_slots, 2, segment_len, model.num_kv_heads, model.head_dim)
        if data is None:
            data = torch.zeros(shape, dtype=model.torch_dtype, device=device)
        elif tuple(data.shape) != shape or data.dtype != model.torch_dtype:
            raise ValueError(
                f"data: expected {list(shape)} {model.torch_dtype}, got {list(data.shape)} {data.dtype}"
            )
        self.model = model
        self.data = data

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        return self.data.shape[1]

    @functools.cached_property
    def host_bytes(self):
        """CPU only: ``data`` as a numpy ``uint8`` view ``[L, S, 2, C, H_kv, D * itemsize]``."""
        return self.data.view(torch.uint8).numpy()

    def layer(self, layer: int) -> torch.Tensor:
        """The contiguous ``[num_slots, 2, C, H_kv, D]`` view of one layer."""
        return self._layers[layer]

    @functools.cached_property
    def _layers(self) -> tuple[torch.Tensor, ...]:
        return self.data.unbind(0)  # views made once: a layer's is taken per query and put
