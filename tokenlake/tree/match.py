"""Prefix matching: the longest cached prefix of a token sequence in a prefix tree (read-only;
:meth:`tokenlake.tree.prefix_tree.PrefixTree.match` adds the optional LRU touch)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tokenlake.keys import as_tokens
from tokenlake.tree.node import PrefixMatch, common_prefix_len

if TYPE_CHECKING:
    from tokenlake.tree.index import TreeIndex


def longest_prefix(
    tree: TreeIndex, token_ids: Iterable[int] | np.ndarray, resume: PrefixMatch | None = None
) -> PrefixMatch:
    """Full segments matched from the root by chained key (tokens compared, so a key
        collision is no match), then the child continuing the match longest (a tail or a
        sealed segment, found through its first token).

        ``resume``: an earlier match of the same ``token_ids`` (or of a prefix of them). While its
        last full segment is still in the tree, so are all of its ancestors (eviction takes
        leaves first), and matching goes on from there: the same result, without comparing the
        segments again (a long prompt waiting for admission is matched at every decision).

    A segment in the host tier matches (the plan loads it back); one whose demotion is still in
    flight does not, nor do its descendants."""
    tokens = as_tokens(token_ids)
    seg = tree.segment_len
    tiered = tree.tier.enabled
    node, nodes, pos = tree.root, [], 0
    if resume is not None and resume.nodes and len(resume.nodes) * seg <= len(tokens):
        last = resume.nodes[-1]
        if tree.get(last.key) is last and (not tiered or all(n.readable for n in resume.nodes)):
            node, nodes, pos = last, list(resume.nodes), len(resume.nodes) * seg
    while pos + seg <= len(tokens):
        chunk = tokens[pos : pos + seg]
        child = node.children.get(tree.hasher.key(node.key, chunk))
        if child is None or len(child.tokens) != seg or not np.array_equal(child.tokens, chunk):
            break
        if tiered and not child.readable:  # its demotion to the host tier is in flight
            break
        nodes.append(child)
        node, pos = child, pos + seg
    partial, partial_len = None, 0
    if pos < len(tokens):
        rest = tokens[pos : pos + seg]
        for cand in node.by_first.get(int(rest[0]), ()):
            if tiered and not cand.readable:
                continue
            n = common_prefix_len(cand.tokens, rest)
            if n > partial_len:
                partial, partial_len = cand, n
    return PrefixMatch(tuple(nodes), partial, partial_len, seg)
