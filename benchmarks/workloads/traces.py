"""Loading Mooncake-format traces and turning ``hash_ids`` into deterministic token ids.

Schema (one JSON object per line; plain, gzip or xz, recognised by content):

- ``timestamp``: arrival in ms (a number; the file need not be sorted);
- ``input_length`` (>= 1) and ``output_length`` (>= 0): token counts;
- ``hash_ids``: chained ids of ``block_size``-token blocks, equal id = equal prefix. Either
  every block is hashed (the last one may be partial: ``ceil(input_length / B)`` ids, as the
  Mooncake traces) or only whole blocks are (``floor(input_length / B)`` ids): the unhashed
  tail then counts as tokens no other request shares;
- optional ``session_id`` (a string or an int) and ``block_size`` (an int).

The block size is read from the lines' ``block_size`` field, or given, or inferred when exactly
one power of two fits every line; it is never assumed. Every malformed line raises
:class:`TraceError` naming the file, the line number and the field.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

REPO_ROOT = Path(__file__).resolve().parents[2]
TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"
CONVERSATION_TRACE = TRACES_DIR / "mooncake_fast25_conversation_trace.jsonl.gz"
SYNTHETIC_TRACE = TRACES_DIR / "mooncake_fast25_synthetic_trace.jsonl.gz"
# the first 1,000 requests of the conversation trace, shipped for clones without ../shared
BUNDLED_CONVERSATION_HEAD = (
    Path(__file__).resolve().parents[1] / "data" / "conversation_trace_head1000.jsonl.gz"
)
CANDIDATE_BLOCK_SIZES = tuple(2**k for k in range(14))  # 1 .. 8192 tokens


class TraceError(ValueError):
    """A trace that cannot be replayed: the message names the file, line and field."""


def conversation_trace(min_requests: int = 0) -> Path:
    """The full shared conversation trace if present, else the bundled excerpt (enough for
    ``min_requests`` <= 1000)."""
    if CONVERSATION_TRACE.exists() or min_requests > 1000:
        return CONVERSATION_TRACE
    return BUNDLED_CONVERSATION_HEAD


@dataclass(frozen=True)
class TraceRequest:
    """One validated line. ``line_no`` (1-based) keys the request's unique tail tokens."""

    arrival_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    line_no: int = 0
    block_size: int | None = None  # the line's own field, if it has one

    def num_blocks(self, block_size: int) -> int:
        """Blocks covering the prompt: the hashed ones plus an unhashed partial tail."""
        return -(-self.input_len // block_size)


def open_trace(path: Path | str):
    """A text stream over ``path``, decompressing gzip or xz by their magic bytes."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"trace {path} not found; pass --trace PATH (the shared traces live in {TRACES_DIR})"
        )
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    if magic == b"\xfd7zXZ\x00":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _field(row: dict, name: str, where: str, kind: type, low: float, optional: bool = False):
    if name not in row:
        if optional:
            return None
        raise TraceError(f"{where}: field {name!r} is missing")
    value = row[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    if not ok or value < low:
        what = "a number" if kind is float else "an int"
        raise TraceError(f"{where}: field {name!r}: expected {what} >= {low:g}, got {value!r}")
    return value


def parse_line(line: str, name: str, line_no: int) -> TraceRequest:
    """Line ``line_no`` of the trace file ``name`` as a :class:`TraceRequest`."""
    where = f"{name} line {line_no}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    timestamp = _field(row, "timestamp", where, float, 0)
    input_len = _field(row, "input_length", where, int, 1)
    output_len = _field(row, "output_length", where, int, 0)
    block_size = _field(row, "block_size", where, int, 1, optional=True)
    ids = row.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: field 'hash_ids': expected a list of ints, got {ids!r:.60}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise TraceError(f"{where}: field 'hash_ids'[{i}]: expected an int >= 0, got {h!r}")
    session = row.get("session_id")
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        raise TraceError(f"{where}: field 'session_id': expected a string or int, got {session!r}")
    return TraceRequest(
        float(timestamp),
        input_len,
        output_len,
        tuple(ids),
        None if session is None else str(session),
        line_no,
        block_size,
    )


def fits(req: TraceRequest, block_size: int) -> bool:
    """Whether ``hash_ids`` covers the prompt in ``block_size`` blocks (all or whole ones)."""
    return len(req.hash_ids) in (req.input_len // block_size, -(-req.input_len // block_size))


def resolve_block_size(rows: list[TraceRequest], given: int | None, name: str) -> int:
    """The trace's block size: the lines' own field, else ``given``, else the one power of two
    that fits every line. Raises :class:`TraceError` on a conflict or an ambiguity."""
    own = {r.block_size for r in rows if r.block_size is not None}
    if len(own) > 1:
        raise TraceError(f"{name}: field 'block_size' differs between lines: {sorted(own)}")
    if own and given is not None and own != {given}:
        raise TraceError(f"{name}: field 'block_size' is {own.pop()}, but {given} was given")
    block_size = own.pop() if own else given
    if block_size is None:
        fitting = [b for b in CANDIDATE_BLOCK_SIZES if all(fits(r, b) for r in rows)]
        if len(fitting) != 1:
            raise TraceError(
                f"{name}: cannot infer the block size (powers of two that fit every line: "
                f"{fitting or 'none'}); pass --block-size"
            )
        block_size = fitting[0]
    for r in rows:
        if not fits(r, block_size):
            raise TraceError(
                f"{name} line {r.line_no}: field 'hash_ids': {len(r.hash_ids)} ids for "
                f"input_length {r.input_len} at block size {block_size} (expected "
                f"{r.input_len // block_size} or {-(-r.input_len // block_size)})"
            )
    return block_size


def load_trace(
    path: Path | str, limit: int | None = None, block_size: int | None = None
) -> list[TraceRequest]:
    """Read and validate up to ``limit`` requests in file order (blank lines are skipped);
    ``block_size`` checks ``hash_ids`` against it (see :func:`read_trace` to get it back)."""
    return read_trace(path, limit, block_size)[0]


def read_trace(
    path: Path | str, limit: int | None = None, block_size: int | None = None
) -> tuple[list[TraceRequest], int]:
    """Validated requests and the trace's block size (:func:`resolve_block_size`)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit: expected an int >= 0 or None, got {limit!r}")
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise ValueError(f"block_size: expected an int >= 1 or None, got {block_size!r}")
    name = Path(path).name
    rows: list[TraceRequest] = []
    with open_trace(path) as f:
        try:
            for line_no, line in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    break
                if line.strip():
                    rows.append(parse_line(line, name, line_no))
        except (OSError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
            raise TraceError(f"{name}: cannot read past line {len(rows)} ({e})") from None
    if not rows:
        raise TraceError(f"{name}: no requests")
    return rows, resolve_block_size(rows, block_size, name)


class TokenSynth:
    """Each distinct block id gets a fixed random token sequence; equal ids, equal tokens.

    ``scale`` shrinks every length by that factor (a 512-token block becomes
    ``block_size // scale`` tokens) so long traces fit a small CPU run. An unhashed tail gets
    tokens of its own, keyed by the request's line.
    """

    def __init__(
        self,
        block_size: int = 512,
        scale: int = 1,
        vocab_size: int = 32_000,
        per_session_ids: bool = False,
    ) -> None:
        if block_size % scale:
            raise ValueError(f"scale: expected a divisor of block_size={block_size}, got {scale}")
        self.block_len = block_size // scale
        self.scale = scale
        self.vocab_size = vocab_size
        self.per_session_ids = per_session_ids
        self._cache: dict[tuple, np.ndarray] = {}

    def _block(self, key: tuple) -> np.ndarray:
        tokens = self._cache.get(key)
        if tokens is None:
            seed = xxhash.xxh64_intdigest("/".join(map(str, key)).encode())
            rng = np.random.default_rng(seed)
            tokens = rng.integers(0, self.vocab_size, self.block_len, dtype=np.int32)
            self._cache[key] = tokens
        return tokens

    def input_len(self, req: TraceRequest) -> int:
        return -(-req.input_len // self.scale)

    def output_len(self, req: TraceRequest) -> int:
        return max(1, -(-req.output_len // self.scale))

    def prompt(self, req: TraceRequest) -> np.ndarray:
        """Token ids of the (scaled) prompt; the last block is truncated to the input length."""
        scope = req.session_id if self.per_session_ids else None
        keys = [(scope, h) for h in req.hash_ids]
        n = self.input_len(req)
        if len(keys) * self.block_len < n:
            keys.append(("tail", req.line_no, req.arrival_ms))
        blocks = [self._block(k) for k in keys]
        tokens = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int32)
        return tokens[:n]
