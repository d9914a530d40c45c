"""Every control message of the data plane, as msgpack-encoded frozen dataclasses.

Wire format: one msgpack map ``{"version": VERSION, "type": <class name>, "fields": [...]}``
(field values in declaration order). Integer arrays travel as msgpack extension type 1
(little-endian int32 bytes). Nothing is ever pickled onto a socket: :func:`decode` only
builds the classes listed here and rejects another version or an unknown type.

Bulk tensors never travel in these messages; they stay in shared buffers or move over
``torch.distributed`` point-to-point under a ``tag`` named here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack
import numpy as np

from tokenlake.errors import TokenLakeError

VERSION = 1
_INT32_ARRAY = 1


class ProtocolError(TokenLakeError):
    """A message could not be decoded (corrupt, unknown type or another protocol version)."""


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
    chunks: list


@dataclass(frozen=True)
class Retire:
    """Scheduler → compute process: the control plane committed or aborted ``epoch``."""

    seq: int
    epoch: int


MESSAGES = (
    Ready, Reply, Configure, BindQuery, RunQuery, BindPut, Put, CopyLocal, CopyRemote, Stop,
    RunStep, Retire,
)  # fmt: skip
_BY_NAME = {cls.__name__: cls for cls in MESSAGES}


def _default(value: object) -> object:
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim != 1:
            raise TypeError(f"only 1-D integer arrays are sent, got {value.dtype} {value.shape}")
        return msgpack.ExtType(_INT32_ARRAY, value.astype("<i4", copy=False).tobytes())
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def _ext_hook(code: int, data: bytes) -> object:
    if code != _INT32_ARRAY:
        raise ProtocolError(f"message: unknown extension type {code}")
    return np.frombuffer(data, dtype="<i4")


def encode(message: object) -> bytes:
    """The wire bytes of one message dataclass."""
    if type(message) not in _BY_NAME.values():
        raise TypeError(f"message: not a data-plane message: {type(message).__name__}")
    values = [getattr(message, f.name) for f in dataclasses.fields(message)]
    payload = {"version": VERSION, "type": type(message).__name__, "fields": values}
    return msgpack.packb(payload, default=_default, use_bin_type=True)


def decode(data: bytes) -> object:
    """The message dataclass encoded in ``data``; :class:`ProtocolError` if it is not one."""
    try:
        payload = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"message: not valid msgpack ({e})") from None
    if not isinstance(payload, dict) or payload.get("version") != VERSION:
        version = payload.get("version") if isinstance(payload, dict) else None
        raise ProtocolError(f"message: expected protocol version {VERSION}, got {version!r}")
    cls = _BY_NAME.get(payload.get("type"))
    fields = payload.get("fields")
    if cls is None or not isinstance(fields, list):
        raise ProtocolError(f"message: unknown message type {payload.get('type')!r}")
    try:
        return cls(*fields)
    except TypeError as e:
        raise ProtocolError(f"message: bad fields for {cls.__name__} ({e})") from None
