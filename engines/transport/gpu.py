"""GPU-only pieces of the data plane, behind the same interfaces as the CPU path.

NOT RUN ON A GPU: this machine has none. Written against the documented APIs of
``torch.cuda.Event(interprocess=True)`` / ``Event.from_ipc_handle``,
``torch.cuda.MemPool`` + ``ProcessGroupNCCL.register_mem_pool`` and the CUDA MPS control
daemon (``nvidia-cuda-mps-control``).

- :class:`ClientEvents` / :class:`EventWaiter`: the compute engine records an interprocess
  event after writing ``q_buf``/``kv_buf``; an engine makes its stream wait on it before
  reading (no host synchronisation on the compute side), and synchronises its own stream
  before replying, so a reply means the engine's writes have landed.
- :class:`NcclStaging`: staging buffers for point-to-point transfers carved from a
  ``MemPool`` registered with the NCCL communicator (``ncclCommRegister`` under the hood).
- :class:`MpsDaemon`: start/stop the MPS control daemon so the three processes of an
  instance share one GPU concurrently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import torch

from tokenlake.errors import InvalidArgumentError


class ClientEvents:
    """One interprocess event per instance, created by the driver (compute-engine side)."""

    def __init__(self, num_instances: int, device: torch.device) -> None:
        self.events = {}
        with torch.cuda.device(device):
            for i in range(num_instances):
                # interprocess events must not time (CUDA: cudaEventDisableTiming)
                self.events[i] = torch.cuda.Event(
                    enable_timing=False, blocking=False, interprocess=True
                )

    @property
    def handles(self) -> dict[int, bytes]:
        """The events' IPC handles, to pass to engine processes at spawn time."""
        return {i: bytes(e.ipc_handle()) for i, e in self.events.items()}

    def record(self, instance_id: int) -> None:
        """Mark "this instance's buffers are written" on the current stream."""
        self.events[instance_id].record(torch.cuda.current_stream())


class EventWaiter:
    """The engine side of :class:`ClientEvents`."""

    def __init__(self, device: torch.device, handles: dict[int, bytes]) -> None:
        torch.cuda.set_device(device)
        self.events = {i: torch.cuda.Event.from_ipc_handle(device, h) for i, h in handles.items()}

    def wait(self, origin: int) -> None:
        """Make the current stream wait for the origin's last record (no host sync)."""
        self.events[origin].wait(torch.cuda.current_stream())

    def finish(self) -> None:
        """Block until this engine's queued GPU work is done (before replying)."""
        torch.cuda.current_stream().synchronize()


class NcclStaging:
    """Point-to-point staging memory registered with an NCCL process group.

    One arena of ``nbytes`` allocated inside a ``torch.cuda.MemPool`` backed by the group's
    NCCL allocator, registered once; :meth:`empty` hands out aligned views (reset with
    :meth:`reset` when a transfer's buffers are no longer in use) and falls back to an
    unregistered tensor when the arena is full.
    """

    def __init__(self, group, nbytes: int, device: torch.device) -> None:
        allocator = getattr(group, "mem_allocator", None)
        if allocator is None or not hasattr(group, "register_mem_pool"):
            raise InvalidArgumentError("group: this torch build cannot register NCCL buffers")
        self.pool = torch.cuda.MemPool(allocator)
        with torch.cuda.use_mem_pool(self.pool):
            self.arena = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # torch registers a pool with the group's communicators that exist; its point-to-point
        # communicators are made at each pair's first transfer, so there may be none yet
        # (then it raises): unregistered memory still works, without NCCL's zero-copy path
        try:
            group.register_mem_pool(self.pool)
            self.registered = True
        except RuntimeError:
            self.registered = False
        self._group = group
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // 256) * 256
        if start + nbytes > self.arena.numel():
            return torch.empty(shape, dtype=dtype, device=self.arena.device)
        self._used = start + nbytes
        return self.arena[start : start + nbytes].view(dtype).view(shape)

    def reset(self) -> None:
        self._used = 0

    def close(self) -> None:
        if self.registered:
            self._group.deregister_mem_pool(self.pool)


class MpsDaemon:
    """The CUDA MPS control daemon for this launcher's engines.

    :meth:`start` runs ``nvidia-cuda-mps-control -d`` with private pipe and log directories
    and exports ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY`` so processes spawned
    afterwards join it; :meth:`stop` sends ``quit`` and restores the environment.
    """

    BINARY = "nvidia-cuda-mps-control"

    def __init__(self) -> None:
        self._dir: str | None = None
        self._saved: dict[str, str | None] = {}

    @property
    def env(self) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self._dir, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self._dir, "log"),
        }

    def start(self, timeout_s: float = 30.0) -> None:
        if shutil.which(self.BINARY) is None:
            raise InvalidArgumentError(f"use_mps: {self.BINARY} is not on PATH")
        self._dir = tempfile.mkdtemp(prefix="tokenlake-mps-")
        env = self.env
        for path in env.values():
            os.makedirs(path, exist_ok=True)
        subprocess.run(
            [self.BINARY, "-d"], env={**os.environ, **env}, check=True, timeout=timeout_s
        )
        for key, value in env.items():
            self._saved[key] = os.environ.get(key)
            os.environ[key] = value

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._dir is None:
            return
        try:
            subprocess.run(
                [self.BINARY],
                input=b"quit\n",
                env={**os.environ, **self.env},
                check=False,
                timeout=timeout_s,
            )
        finally:
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
