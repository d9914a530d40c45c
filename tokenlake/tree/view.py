"""The read-only view of the prefix tree that ``Pool.get_prefix_tree`` hands to schedulers."""

from __future__ import annotations

from tokenlake.tree.prefix_tree import PrefixMatch, PrefixTree


class PrefixTreeView:
    def __init__(self, tree: PrefixTree) -> None:
        self._tree = tree

    def match(self, token_ids, resume: PrefixMatch | None = None) -> PrefixMatch:
        """Cached prefix of ``token_ids`` (``.num_tokens``); does not count as an access.
        ``resume``: an earlier match of the same tokens, to go on from (same result)."""
        return self._tree.match(token_ids, resume=resume)

    @property
    def segment_len(self) -> int:
        return self._tree.segment_len

    @property
    def num_segments(self) -> int:
        return self._tree.num_nodes

    @property
    def num_replicas(self) -> int:
        return self._tree.num_replicas
