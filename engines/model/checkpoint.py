"""Reading a Hugging Face checkpoint's tensors (``*.safetensors``, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenlake.errors import InvalidArgumentError

INDEX = "model.safetensors.index.json"


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those the sharded index names, else ``*.safetensors``."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"model: unreadable {index}: {e!r}") from None
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InvalidArgumentError(f"model: {INDEX} names missing shards {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgumentError(
            f"model: no *.safetensors in {str(path)!r} (only safetensors checkpoints are read)"
        )
    return files


def load_tensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, converted to ``dtype``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = f.get_tensor(name).to(dtype)
    return out


class TensorTable:
    """Named tensors taken one by one; a missing or misshapen one is an error naming it."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._tensors.pop(name, None)
        if t is None:
            raise InvalidArgumentError(f"model: checkpoint has no tensor {name!r}")
        if tuple(t.shape) != shape:
            raise InvalidArgumentError(
                f"model: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}"
            )
        return t

    def has(self, name: str) -> bool:
        return name in self._tensors

    def leftover(self) -> list[str]:
        return sorted(self._tensors)
