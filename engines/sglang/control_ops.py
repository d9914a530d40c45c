"""The control service's request vocabulary, shared by the service and its clients."""

from __future__ import annotations

from tokenlake.errors import InvalidArgumentError

OPS = (
    "hello",
    "match",
    "stored",
    "finish",
    "plan",
    "commit",
    "abort",
    "locate",
    "stats",
    "release",
    "attach",
    "check",
    "leave",
)


def request_prefix(instance_id: int) -> str:
    """Every pool request id of worker ``instance_id`` starts with this: a worker can plan,
    query and finish only its own requests, and two workers' ids never collide."""
    return f"w{instance_id}:"


def check_request(request: object) -> tuple[str, int]:
    """``(op, seq)`` of a decoded request map; :class:`InvalidArgumentError` otherwise."""
    if not isinstance(request, dict):
        raise InvalidArgumentError(f"request: expected a map, got {type(request).__name__}")
    op, seq = request.get("op"), request_seq(request)
    if seq < 0:
        raise InvalidArgumentError(
            f"seq: expected an int in [0, 2**62), got {request.get('seq')!r}"
        )
    if op not in OPS:
        raise InvalidArgumentError(f"op: expected one of {OPS}, got {op!r}")
    return op, seq


def request_seq(request: object) -> int:
    """The request's sequence number (the reply carries it back), -1 if it has none."""
    seq = request.get("seq") if isinstance(request, dict) else None
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 2**62:
        return -1
    return seq
