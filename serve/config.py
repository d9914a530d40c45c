"""The server's frozen configuration (every command-line flag lands here)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.errors import InvalidArgumentError

DATA_PLANES = ("local", "mp")
SCHEDULER_MODES = ("elastic", "colocated")


@dataclass(frozen=True)
class ServeConfig:
    """How ``python -m tokenlake.serve`` runs.

    Args:
        model: a Hugging Face checkpoint directory, or ``"tiny-random"``.
        served_model_name: the name clients pass as ``model`` (default: ``model``).
        dtype: ``"auto"`` (the checkpoint's), ``"float32"`` or ``"bfloat16"``.
        num_instances: instances of the pool (ranks ``0..N-1``).
        segment_len: tokens per KV segment (``C``).
        num_slots: segment slots per instance.
        max_model_len: longest prompt + output in tokens (0: the model's, capped by the pool).
        chunk_len: most new tokens of one prefill chunk (a multiple of ``segment_len``).
        max_num_seqs: most requests running at once (more wait in the queue).
        data_plane: ``"local"`` (in-process engines) or ``"mp"`` (engine processes).
        kernel_backend: attention kernels (``None``: by device).
        host, port: where the HTTP API listens (loopback by default).
        seed: seed of ``tiny-random`` and of unseeded sampling.
        profile: measure the scheduler's latency model on the model at start-up.
        scheduler_mode: ``"elastic"`` (prefill batches of DoP 1..N) or ``"colocated"`` (DoP
            1; the Ray launch's, where each instance's compute runs in its own process).
    """

    model: str = "tiny-random"
    served_model_name: str | None = None
    dtype: str = "auto"
    num_instances: int = 4
    segment_len: int = 32
    num_slots: int = 512
    max_model_len: int = 0
    chunk_len: int = 512
    max_num_seqs: int = 64
    data_plane: str = "local"
    kernel_backend: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    profile: bool = True
    torch_threads: int = 0
    scheduler_mode: str = "elastic"

    def __post_init__(self) -> None:
        for name in ("num_instances", "segment_len", "num_slots", "chunk_len", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name}: expected an int >= 1, got {value!r}")
        if isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int):
            raise InvalidArgumentError(
                f"max_model_len: expected an int, got {self.max_model_len!r}"
            )
        if self.max_model_len < 0:
            raise InvalidArgumentError(f"max_model_len: expected >= 0, got {self.max_model_len}")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int):
            raise InvalidArgumentError(
                f"torch_threads: expected an int, got {self.torch_threads!r}"
            )
        if self.torch_threads < 0:
            raise InvalidArgumentError(f"torch_threads: expected >= 0, got {self.torch_threads}")
        if self.chunk_len % self.segment_len:
            raise InvalidArgumentError(
                f"chunk_len: expected a multiple of segment_len={self.segment_len}, "
                f"got {self.chunk_len}"
            )
        if self.scheduler_mode not in SCHEDULER_MODES:
            raise InvalidArgumentError(
                f"scheduler_mode: expected one of {SCHEDULER_MODES}, got {self.scheduler_mode!r}"
            )
        if self.data_plane not in DATA_PLANES:
            raise InvalidArgumentError(
                f"data_plane: expected one of {DATA_PLANES}, got {self.data_plane!r}"
            )
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port: expected 0..65535, got {self.port!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
