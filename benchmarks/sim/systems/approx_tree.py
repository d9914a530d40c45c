"""sgl-router's approximate multi-tenant radix tree, at block granularity.

Model of ``Tree`` in sgl-router (sgl-project/sglang, ``sgl-router/src/policies/tree.rs`` at
commit 4d40eec0; the same structure backs the cache-aware policy in
``sgl-router/src/policies/cache_aware.rs`` at 026f853b and b6f20641): one tree for all workers
("tenants"), each node remembering which tenants inserted it and when each last touched it.

- ``insert(keys, tenant)``: adds the path, attaching the tenant (and its last-access time) to
  every node on it; a tenant's size grows by the tokens of nodes newly attached to it.
- ``prefix_match(keys)``: walks the longest path present for *any* tenant and returns the
  matched tokens and one tenant of the deepest matched node: sgl-router takes "the first key"
  of that node's hash map, an order fixed per node but arbitrary across nodes, modelled here
  by a seeded per-node salt. The chosen tenant's access time is refreshed up to the root.
- ``smallest_tenant()``: the tenant with the fewest tokens (ties: lowest index, where
  sgl-router iterates a hash map).
- ``evict_by_size(max_tokens)``: for each tenant above ``max_tokens``, detach it from its
  least recently used leaves (a parent becomes a candidate once no child holds the tenant)
  until it fits; nodes no tenant holds are removed.

sgl-router keys characters of the request text; the simulator keys chained prompt blocks, so
sizes are in tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

import numpy as np


class _Node:
    __slots__ = ("key", "parent", "num_tokens", "children", "tenants", "salt")

    def __init__(self, key: Hashable, parent: _Node | None, num_tokens: int, salt: int) -> None:
        self.key, self.parent, self.num_tokens, self.salt = key, parent, num_tokens, salt
        self.children: dict[Hashable, _Node] = {}
        self.tenants: dict[int, float] = {}  # tenant -> last access time


class ApproxTree:
    """Args: num_tenants (workers 0..n-1, registered empty as sgl-router's ``init_workers``);
    seed (the per-node tenant order)."""

    def __init__(self, num_tenants: int, seed: int = 0) -> None:
        if num_tenants < 1:
            raise ValueError(f"num_tenants: expected >= 1, got {num_tenants}")
        self._rng = np.random.default_rng(seed)
        self.root = _Node(None, None, 0, 0)
        self.root.tenants = dict.fromkeys(range(num_tenants), 0.0)
        self.tenant_tokens = [0] * num_tenants

    def _first_tenant(self, node: _Node) -> int:
        return min(node.tenants, key=lambda t: hash((node.salt, t)))

    def insert(self, keys: Sequence[Hashable], lengths: Sequence[int], tenant: int, now: float):
        node = self.root
        node.tenants[tenant] = now
        for key, n in zip(keys, lengths, strict=True):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node, n, int(self._rng.integers(2**62)))
            if tenant not in child.tenants:
                self.tenant_tokens[tenant] += child.num_tokens
            child.tenants[tenant] = now
            node = child

    def prefix_match(self, keys: Sequence[Hashable], now: float) -> tuple[int, int]:
        """(matched tokens, a tenant of the deepest matched node); touches that tenant."""
        node, matched = self.root, 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            node, matched = child, matched + child.num_tokens
        tenant = self._first_tenant(node)
        while node is not None:
            node.tenants[tenant] = now
            node = node.parent
        return matched, tenant

    def smallest_tenant(self) -> int:
        return min(range(len(self.tenant_tokens)), key=self.tenant_tokens.__getitem__)

    def tokens_of(self, tenant: int, keys: Sequence[Hashable]) -> int:
        """Tokens of ``keys``' prefix that ``tenant`` holds (for tests and checks)."""
        node, matched = self.root, 0
        for key in keys:
            node = node.children.get(key)
            if node is None or tenant not in node.tenants:
                break
            matched += node.num_tokens
        return matched

    def _holds_below(self, node: _Node, tenant: int) -> bool:
        return any(tenant in c.tenants for c in node.children.values())

    def evict_by_size(self, max_tokens: int) -> None:
        heap: list[tuple[float, int, int, _Node]] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for t, at in node.tenants.items():
                if not self._holds_below(node, t):
                    heap.append((at, t, id(node), node))
        heapq.heapify(heap)
        while heap:
            _, tenant, _, node = heapq.heappop(heap)
            if self.tenant_tokens[tenant] <= max_tokens or tenant not in node.tenants:
                continue
            del node.tenants[tenant]
            self.tenant_tokens[tenant] -= node.num_tokens
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[node.key]
            if (
                parent is not self.root
                and tenant in parent.tenants
                and not self._holds_below(parent, tenant)
            ):
                heapq.heappush(heap, (parent.tenants[tenant], tenant, id(parent), parent))

    def check_invariants(self) -> None:
        sizes = [0] * len(self.tenant_tokens)
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.tenants or node.children, "an empty leaf was left in the tree"
            for t in node.tenants:
                sizes[t] += node.num_tokens
                assert t in node.parent.tenants, "a tenant holds a node but not its parent"
            stack.extend(node.children.values())
        assert sizes == self.tenant_tokens, (sizes, self.tenant_tokens)
