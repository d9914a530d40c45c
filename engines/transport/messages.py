"""Every control message of the data plane, as frozen dataclasses on the
:mod:`tokenlake.wire` codec (versioned msgpack, whitelist decoding, every field checked
against its annotation; integer arrays travel as raw little-endian int32). Nothing is ever
pickled onto a socket. Frames are sealed by :mod:`tokenlake.engines.transport.auth` on top.

Bulk tensors never travel in these messages; they stay in shared buffers or move over
``torch.distributed`` point-to-point under a ``tag`` named here. The range of every field
is checked by the receiving engine against its own geometry before anything is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.wire import Codec, WireError

VERSION = 2
MAX_FRAME_BYTES = 1 << 26

ProtocolError = WireError  # what a frame that is not a valid message raises


@dataclass(frozen=True)
class Ready:
    """Engine → launcher: the engine's socket is bound and it is serving."""

    role: str
    instance_id: int
    endpoint: str
    pid: int


@dataclass(frozen=True)
class Reply:
    """Engine → caller: request ``seq`` finished (``ok``, with the handler's ``payload``) or
    failed with ``error``."""

    seq: int
    ok: bool
    error: str = ""
    payload: bytes = b""


@dataclass(frozen=True)
class Configure:
    """Lay the shared buffers out for a pool; drops every binding."""

    seq: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_slots: int
    segment_len: int
    max_q_rows: int
    max_kv_rows: int
    backend: str  # "" = by device
    logit_cap: float = 0.0  # the model's attention soft cap (ModelShape.logit_cap)


@dataclass(frozen=True)
class BindQuery:
    """One holder's part of a query plan (a :class:`tokenlake.plans.HolderPart`).

    The origin's q rows start at row ``q_offset`` of its shared q buffer; the holder writes
    its ``(o, lse)`` for the part's rows at ``q_offset`` of the origin's output region.
    """

    seq: int
    origin: int
    epoch: int
    binding: int
    q_offset: int
    rows: np.ndarray
    q_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    last_len: np.ndarray


@dataclass(frozen=True)
class RunQuery:
    """Compute a bound part for ``layer``. ``tag < 0``: read the origin's shared q buffer and
    write its shared output region; else receive q rows from the caller's rank and send
    ``o`` and ``lse`` back under tags ``tag``, ``tag + 1``, ``tag + 2``."""

    seq: int
    origin: int
    binding: int
    layer: int
    tag: int


@dataclass(frozen=True)
class BindPut:
    """Runs of a transfer plan from another host that land on this engine's instance: rows
    ``src_row[i]:src_row[i] + length[i]`` of the packed rows each :class:`Put` receives go to
    slot ``dst_slot[i]`` from token ``dst_offset[i]``."""

    seq: int
    origin: int
    epoch: int
    binding: int
    src_row: np.ndarray
    length: np.ndarray
    dst_slot: np.ndarray
    dst_offset: np.ndarray


@dataclass(frozen=True)
class Put:
    """Store one layer of a bound put: receive the packed rows ``[n, 2, H_kv, D]`` from the
    caller's rank under ``tag``."""

    seq: int
    origin: int
    binding: int
    layer: int
    tag: int


@dataclass(frozen=True)
class CopyLocal:
    """Copy the first ``length[i]`` tokens (all layers) of slot ``src_slot[i]`` of instance
    ``src_instance[i]`` (on this host) into this instance's slot ``dst_slot[i]``."""

    seq: int
    src_instance: np.ndarray
    src_slot: np.ndarray
    dst_slot: np.ndarray
    length: np.ndarray


@dataclass(frozen=True)
class CopyRemote:
    """Segment copies between hosts: receive ``recv_len`` tokens into ``recv_slot`` from rank
    ``recv_peer`` under ``recv_tag``; send ``send_len`` tokens of ``send_slot`` to rank
    ``send_peer`` under ``send_tag``. Receives are posted before sends, so two engines that
    exchange segments in the same iteration never wait on each other."""

    seq: int
    recv_peer: np.ndarray
    recv_slot: np.ndarray
    recv_len: np.ndarray
    recv_tag: np.ndarray
    send_peer: np.ndarray
    send_slot: np.ndarray
    send_len: np.ndarray
    send_tag: np.ndarray


@dataclass(frozen=True)
class Stats:
    """Answer with the engine's counters (a msgpack map of ints in the reply's payload)."""

    seq: int


@dataclass(frozen=True)
class Stop:
    """Reply, then exit the engine's loop."""

    seq: int


@dataclass(frozen=True)
class RunStep:
    """Scheduler → compute process: run one iteration's sub-batches of the instances this
    process drives. ``plans`` is a :mod:`tokenlake.plan_wire` encoding of a ``Plans``
    holding only those sub-batches; ``chunks`` one encoded ``Chunk`` per request."""

    seq: int
    plans: bytes
    chunks: tuple[bytes, ...]


@dataclass(frozen=True)
class Retire:
    """Scheduler → compute process: the control plane committed or aborted ``epoch``."""

    seq: int
    epoch: int


@dataclass(frozen=True)
class Regroup:
    """Restarted processes of ``instance_ids`` rejoined, their engines serving at
    ``query_endpoints[k]`` / ``transfer_endpoints[k]``: compute processes reconnect to them,
    and every process re-forms the point-to-point group (if any) under ``generation``."""

    seq: int
    generation: int
    instance_ids: np.ndarray
    query_endpoints: tuple[str, ...]
    transfer_endpoints: tuple[str, ...]


MESSAGES = (
    Ready, Reply, Configure, BindQuery, RunQuery, BindPut, Put, CopyLocal, CopyRemote, Stats,
    Stop, RunStep, Retire, Regroup,
)  # fmt: skip
CODEC = Codec("message", VERSION, MESSAGES, max_bytes=MAX_FRAME_BYTES)


def encode(message: object) -> bytes:
    """The wire bytes of one message dataclass."""
    return CODEC.encode(message)


MAX_SEQ = (1 << 63) - 1  # a request's number: a signed 64-bit counter, from 1


def decode(data: bytes) -> object:
    """The message dataclass encoded in ``data``; :class:`WireError` if it is not one, or
    if its ``seq`` is outside [0, 2**63) (the counters start at 1; -1 answers a frame whose
    number could not be read)."""
    message = CODEC.decode(data)
    seq = getattr(message, "seq", 0)
    if not -1 <= seq <= MAX_SEQ:
        raise WireError(f"{type(message).__name__}.seq: expected an int in [-1, {MAX_SEQ}], "
                        f"got {seq}")  # fmt: skip
    return message
