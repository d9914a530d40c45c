"""Prefixes being computed: the segments that prefill chunks in flight, or chosen earlier in
the same decision, store when they commit.

The pool can only hit committed segments, so a new request arriving while another request's
prefill of the same document is in flight would compute the document again. Instead it waits
(SGLang defers a request whose prefix an earlier request of the batch is computing the same
way): a new request whose next uncached segment is pending is left out of the decision, and
the next decision after the commit finds that segment, and what follows, cached.
"""

from __future__ import annotations

import numpy as np


class PendingPrefixes:
    """Full segments of chunks being computed, by (end position, segment tokens); a hit is
    confirmed by comparing the whole prefix, so requests that share a segment but not what
    precedes it never wait for each other."""

    def __init__(self, segment_len: int) -> None:
        self.segment_len = segment_len
        self._by_end: dict[tuple[int, bytes], list[np.ndarray]] = {}

    def add(self, token_ids: np.ndarray, start: int, end: int) -> None:
        """A chunk computing ``token_ids[start:end]`` (its segments up to ``end`` commit
        together)."""
        seg = self.segment_len
        for e in range((start // seg + 1) * seg, end + 1, seg):
            key = (e, token_ids[e - seg : e].tobytes())
            self._by_end.setdefault(key, []).append(token_ids)

    def covers(self, token_ids: np.ndarray, start: int) -> bool:
        """Whether the full segment of ``token_ids`` holding position ``start`` (the first
        token a new request would compute) is pending with the same prefix."""
        seg = self.segment_len
        e = (start // seg + 1) * seg
        if e > len(token_ids):
            return False  # only a partial tail is left: nothing to wait for
        producers = self._by_end.get((e, token_ids[e - seg : e].tobytes()), ())
        return any(np.array_equal(p[: e - seg], token_ids[: e - seg]) for p in producers)
