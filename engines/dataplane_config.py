"""Configuration and error types of the multi-process data plane (docs/architecture.md#the-floors)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.errors import InvalidArgumentError, TokenLakeError


class PeerFailedError(TokenLakeError):
    """An engine process died or did not answer within ``DataPlaneConfig.timeout_s``.

    ``instance_id`` is the instance it belongs to and ``role`` is ``"query"`` or
    ``"transfer"``. The caller should abort the iteration, ``Pool.drop_instance(instance_id)``
    and re-plan (see :meth:`tokenlake.engines.clusters.mp.MPCluster.fail_over`).
    """

    def __init__(self, instance_id: int, role: str, reason: str) -> None:
        super().__init__(f"instance {instance_id} ({role} engine): {reason}")
        self.instance_id = instance_id
        self.role = role


class RemoteEngineError(TokenLakeError):
    """An engine process answered a request with an error (a bug or a protocol mismatch)."""


_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class DataPlaneConfig:
    """How the multi-process data plane is launched and how long it waits for peers.

    Args:
        max_q_rows: capacity of each instance's shared ``q_buf`` (and output regions), in
            query rows per iteration; a plan needing more raises ``InvalidArgumentError``.
        max_kv_rows: capacity of each instance's shared ``kv_buf``, in new-token rows.
        timeout_s: a peer that has not answered a request after this many seconds is failed.
        startup_timeout_s: how long the launcher waits for every engine to report ready.
        separate_hosts: treat every instance as its own host, so bulk tensors move over
            ``torch.distributed`` point-to-point instead of shared buffers (tests that path
            on one machine, with gloo: CPU only, as NCCL refuses two ranks on one GPU).
        kernel_threads: threads of each query engine's CPU kernels (0: every core).
        device: ``"cpu"`` or ``"cuda"`` (CUDA IPC buffers, NCCL, FlashInfer; not run on a GPU).
        use_mps: start the CUDA MPS control daemon for the engines (``device="cuda"`` only).
        host: address every socket binds to; loopback unless configured otherwise.
        put_parallel_min_bytes: a CPU put of at least this many bytes per call and
            destination is copied by the kernels' threads together, a smaller one by the
            calling thread (``None``: ``puts.PUT_PARALLEL_MIN_BYTES``, never: measured
            faster only while a core is idle; ``1 << 20`` for a host with cores to spare).
    """

    max_q_rows: int = 4096
    max_kv_rows: int = 4096
    timeout_s: float = 10.0
    startup_timeout_s: float = 180.0
    separate_hosts: bool = False
    kernel_threads: int = 0
    device: str = "cpu"
    use_mps: bool = False
    host: str = "127.0.0.1"
    put_parallel_min_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_q_rows", "max_kv_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(
                    f"DataPlaneConfig.{name}: expected a positive int, got {value!r}"
                )
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidArgumentError(
                    f"DataPlaneConfig.{name}: expected a positive number, got {value!r}"
                )
        k = self.kernel_threads
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidArgumentError(f"DataPlaneConfig.kernel_threads: expected >= 0, got {k!r}")
        if self.device not in _DEVICES:
            raise InvalidArgumentError(
                f"DataPlaneConfig.device: expected one of {_DEVICES}, got {self.device!r}"
            )
        if self.use_mps and self.device != "cuda":
            raise InvalidArgumentError("DataPlaneConfig.use_mps: needs device='cuda'")
        if self.separate_hosts and self.device == "cuda":
            # one machine's engines would be NCCL ranks on one GPU, which NCCL refuses
            raise InvalidArgumentError(
                "DataPlaneConfig.separate_hosts: not with device='cuda' on one machine: its "
                "instances exchange through CUDA IPC buffers; NCCL runs only between hosts"
            )
        b = self.put_parallel_min_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise InvalidArgumentError(
                f"DataPlaneConfig.put_parallel_min_bytes: expected None or an int >= 0, got {b!r}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise InvalidArgumentError(
                f"DataPlaneConfig.host: expected a non-empty str, got {self.host!r}"
            )

    @property
    def poll_interval_s(self) -> float:
        """How often a waiting caller checks that its peers' processes are still alive."""
        return min(0.05, self.timeout_s / 4)
