"""The ``torch.distributed`` point-to-point group used between hosts (gloo on CPU, NCCL on
GPU), built as a standalone process group so it never touches the caller's default group.

Ranks: the driver (every compute-engine client of the launcher) is rank 0, the query engine
of instance ``i`` is ``1 + i`` and its transfer engine ``1 + N + i``. Engines only ever wait
for data whose sender has already been told to send, so every send has its matching receive.

Order: NCCL runs the operations between two ranks in the order each side posts them, one after
the other on one stream, so a receive posted before the send that its peer waits for deadlocks
(gloo does not care). Every rank therefore posts its point-to-point operations through
:func:`post`, in one order that both sides of every pair compute alike: by tag (the same on
both sides of a transfer), then peer.

NCCL runs only between hosts: instances on one host exchange through their shared (CUDA IPC)
buffers, never through NCCL ranks on one device, which NCCL refuses.
"""

from __future__ import annotations

import contextlib
import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.validate import canonical_device

DRIVER_RANK = 0


@dataclass(frozen=True)
class GroupSpec:
    """Where the group's store listens and how big the group is.

    ``compute_clients``: every instance's engine client lives in a compute process of its
    own (rank ``1 + 2N + i``, e.g. on the instance's node) instead of all in the driver
    (rank 0). ``generation``: the group is re-formed under a new generation when restarted
    processes rejoin (a process group cannot admit new ranks).
    """

    backend: str  # "gloo" or "nccl"
    host: str
    store_endpoint: str  # the launcher's authenticated store (engines/transport/auth_store.py)
    num_instances: int
    timeout_s: float
    compute_clients: bool = False
    generation: int = 0

    @property
    def world_size(self) -> int:
        return 1 + (3 if self.compute_clients else 2) * self.num_instances

    def client_rank(self, origin: int) -> int:
        """The rank holding instance ``origin``'s engine client (the origin's side of its
        cross-host queries and puts)."""
        if self.compute_clients:
            return rank_of("compute", origin, self.num_instances)
        return DRIVER_RANK


def rank_of(role: str, instance_id: int, num_instances: int) -> int:
    offset = {"query": 0, "transfer": num_instances, "compute": 2 * num_instances}[role]
    return 1 + offset + instance_id


def peer_of(rank: int, num_instances: int) -> tuple[str, int]:
    """``(role, instance_id)`` of a rank (the driver is ``("driver", -1)``)."""
    if rank == DRIVER_RANK:
        return ("driver", -1)
    i = rank - 1
    if i < num_instances:
        return ("query", i)
    if i < 2 * num_instances:
        return ("transfer", i - num_instances)
    return ("compute", i - 2 * num_instances)


def make_store(spec: GroupSpec, secret) -> dist.Store:
    """A client of the launcher's rendezvous store (it needs the cluster secret)."""
    from tokenlake.engines.transport.auth_store import AuthStore

    return AuthStore(spec.store_endpoint, secret, spec.timeout_s)


def connect(
    spec: GroupSpec, store: dist.Store, rank: int, device: torch.device | str | None = None
) -> dist.ProcessGroup:
    """Join the group (blocks until every rank joined, at most ``spec.timeout_s``). NCCL:
    ``device`` (this rank's GPU, ``cuda`` meaning the current one) is made the process's
    device before the group exists, so its communicators are created on it."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if spec.generation:
        store = dist.PrefixStore(f"generation{spec.generation}", store)
    if spec.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.host)]
        return dist.ProcessGroupGloo(store, rank, spec.world_size, opts)
    if spec.backend == "nccl":  # not run on a GPU
        torch.cuda.set_device(canonical_device(device if device is not None else "cuda"))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, spec.world_size, opts)
    raise ValueError(f"spec.backend: expected 'gloo' or 'nccl', got {spec.backend!r}")


@dataclass(frozen=True)
class Membership:
    """A process's place in the group: what it joined with, so that it can :meth:`join`
    again under a new generation when restarted peers rejoin."""

    spec: GroupSpec
    store: dist.Store
    rank: int

    def client_rank(self, origin: int) -> int:
        return self.spec.client_rank(origin)

    def join(self, generation: int | None = None) -> dist.ProcessGroup:
        spec = self.spec if generation is None else replace(self.spec, generation=generation)
        return connect(spec, self.store, self.rank)


def shutdown(group: dist.ProcessGroup | None) -> None:
    """Release the group's connections (best effort: peers may already be gone)."""
    if group is None:
        return
    # a group whose peers died may refuse; the process exits anyway
    with contextlib.suppress(Exception):
        group.shutdown()


_waiters: ThreadPoolExecutor | None = None


def watch(work: dist.Work, timeout_s: float) -> Future:
    """A future that completes when ``work`` does. Gloo's point-to-point works only report
    completion from ``wait()`` (``is_completed()`` stays false and ``get_future()`` is not
    implemented), so a small thread pool waits for them while the caller keeps polling its
    sockets; the wait itself is bounded by ``timeout_s``."""
    global _waiters
    if _waiters is None:
        _waiters = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tokenlake-p2p")
    return _waiters.submit(work.wait, datetime.timedelta(seconds=timeout_s))


def poll_works(works: list[tuple[Future, int]], num_instances: int, what: str) -> list:
    """The watched works ``(future, peer_rank)`` not finished yet; raises
    :class:`PeerFailedError` naming the peer of one that failed."""
    pending = []
    for future, peer in works:
        if not future.done():
            pending.append((future, peer))
        elif future.exception() is not None:
            role, instance = peer_of(peer, num_instances)
            raise PeerFailedError(instance, role, f"{what} failed: {future.exception()}")
    return pending


def wait_works(
    works: list[tuple[dist.Work, int]], num_instances: int, timeout_s: float, what: str
) -> None:
    """Block until point-to-point works ``(work, peer_rank)`` finish, at most ``timeout_s``
    each (engines only wait for transfers whose other side was already told to run).
    Raises :class:`PeerFailedError` naming the peer."""
    for work, peer in works:
        try:
            work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            role, instance = peer_of(peer, num_instances)
            raise PeerFailedError(instance, role, f"{what} failed: {e}") from None


@dataclass(frozen=True)
class P2POp:
    """One point-to-point transfer of this rank: ``kind`` ``"send"`` (``tensor`` to ``peer``)
    or ``"recv"`` (into ``tensor``), under ``tag``, which both sides use."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int


def post(group: dist.ProcessGroup, ops: list[P2POp]) -> list[tuple[dist.Work, P2POp]]:
    """Post ``ops`` by ``(tag, peer)``: the order the peer of each posts its side in, so the
    operations between any two ranks match one for one (see the module's "Order"). Returns
    each op's work, in the order posted."""
    works = []
    for op in sorted(ops, key=lambda op: (op.tag, op.peer)):
        if op.kind not in ("send", "recv"):
            raise ValueError(f"op.kind: expected 'send' or 'recv', got {op.kind!r}")
        call = send if op.kind == "send" else recv
        works.append((call(group, op.tensor, op.peer, op.tag), op))
    return works


def send(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    return group.send([tensor], peer, tag)


def recv(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
    return group.recv([tensor], peer, tag)


class HostStaging:
    """Transfer buffers for gloo: plain tensors (gloo registers nothing)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def reset(self) -> None:
        pass


def make_staging(group, backend: str, nbytes: int, device: torch.device):
    """Where a process allocates point-to-point buffers: an NCCL-registered arena on GPU
    (see :class:`tokenlake.engines.transport.gpu.NcclStaging`), plain tensors with gloo."""
    if backend == "nccl":
        from tokenlake.engines.transport.gpu import NcclStaging

        return NcclStaging(group, nbytes, device)
    return HostStaging(device)
