"""Loading Mooncake-schema traces and turning ``hash_ids`` into deterministic token ids.

Schema (one JSON object per line, optionally gzip-compressed): ``timestamp`` (ms),
``input_length``, ``output_length``, ``hash_ids`` (chained ids of ``block_size``-token
blocks; the last block may be partial), optional ``session_id`` (ids are then scoped to the
session when ``per_session_ids`` is set).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

REPO_ROOT = Path(__file__).resolve().parent.parent
TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"
CONVERSATION_TRACE = TRACES_DIR / "mooncake_fast25_conversation_trace.jsonl.gz"
SYNTHETIC_TRACE = TRACES_DIR / "mooncake_fast25_synthetic_trace.jsonl.gz"
# the first 1,000 requests of the conversation trace, shipped for clones without ../shared
BUNDLED_CONVERSATION_HEAD = (
    Path(__file__).resolve().parent / "data" / "conversation_trace_head1000.jsonl.gz"
)


def conversation_trace(min_requests: int = 0) -> Path:
    """The full shared conversation trace if present, else the bundled excerpt (enough for
    ``min_requests`` <= 1000)."""
    if CONVERSATION_TRACE.exists() or min_requests > 1000:
        return CONVERSATION_TRACE
    return BUNDLED_CONVERSATION_HEAD


@dataclass(frozen=True)
class TraceRequest:
    arrival_ms: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


def load_trace(path: Path | str, limit: int | None = None) -> list[TraceRequest]:
    """Read up to ``limit`` requests in file order (Mooncake traces are sorted by time)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"trace {path} not found; pass --trace PATH (the shared traces live in {TRACES_DIR})"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[TraceRequest] = []
    with opener(path, "rt") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append(
                TraceRequest(
                    arrival_ms=float(row["timestamp"]),
                    input_len=int(row["input_length"]),
                    output_len=int(row["output_length"]),
                    hash_ids=tuple(int(h) for h in row["hash_ids"]),
                    session_id=row.get("session_id"),
                )
            )
    return out


class TokenSynth:
    """Each distinct block id gets a fixed random token sequence; equal ids, equal tokens.

    ``scale`` shrinks every length by that factor (a 512-token block becomes
    ``block_size // scale`` tokens) so long traces fit a small CPU run.
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

    def _block(self, block_id: int, session: str | None) -> np.ndarray:
        key = (session, block_id) if self.per_session_ids else (None, block_id)
        tokens = self._cache.get(key)
        if tokens is None:
            seed = xxhash.xxh64_intdigest(f"{key[0]}/{block_id}".encode())
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
        blocks = [self._block(h, req.session_id) for h in req.hash_ids]
        tokens = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int32)
        return tokens[: self.input_len(req)]
