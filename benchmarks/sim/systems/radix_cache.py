"""One instance's local prefix cache (the baselines' SGLang radix cache, at block granularity).

A request's sequence is a chain of keys with token counts: its prompt's block ids (the last
block may be partial), then its output in blocks keyed by (request, index). Nodes are shared
by key; a node used by a running request is locked; eviction removes the least recently used
unlocked leaf, as SGLang's radix cache does. Memory = tokens of cached nodes + tokens reserved
by running requests that are not in the tree yet.

``eviction="slru"`` is SGLang's ``--radix-eviction-policy slru`` (``SLRUStrategy``,
``sglang/srt/mem_cache/evict_policy.py``): a node inserted by one request has one hit, and
each later request whose insert passes through it adds one; nodes with at least two hits are
protected, and every unprotected leaf goes before any protected one, each segment in LRU
order. ``lru`` (SGLang's default) is plain LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

LRU, SLRU = "lru", "slru"
EVICTIONS = (LRU, SLRU)
SLRU_PROTECTED_HITS = 2  # SGLang's SLRUStrategy(protected_threshold=2)


class _Node:
    __slots__ = ("key", "parent", "num_tokens", "children", "lock", "hits")

    def __init__(self, key: Hashable, parent: _Node | None, num_tokens: int) -> None:
        self.key, self.parent, self.num_tokens = key, parent, num_tokens
        self.children: dict[Hashable, _Node] = {}
        self.lock = 0
        self.hits = 1  # requests whose insert created or passed through it


class Match(NamedTuple):
    num_tokens: int
    path: tuple  # matched nodes, root first (opaque handles for lock/unlock)


class LocalPrefixCache:
    """Args: capacity_tokens: KV tokens the instance holds (cache + running requests);
    eviction: ``lru`` or ``slru`` (see the module doc)."""

    def __init__(self, capacity_tokens: int, eviction: str = LRU) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens: expected > 0, got {capacity_tokens}")
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction: expected one of {EVICTIONS}, got {eviction!r}")
        self.capacity_tokens = capacity_tokens
        self.eviction = eviction
        self.root = _Node(None, None, 0)
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id(node) -> node, oldest first
        self.cached_tokens = 0  # tokens in the tree
        self.locked_tokens = 0  # tokens in locked nodes
        self.reserved_tokens = 0  # tokens of running requests outside the tree
        self.num_evicted_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    def match(self, keys: Sequence[Hashable], touch: bool = True) -> Match:
        node, path, tokens = self.root, [], 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            tokens += child.num_tokens
            node = child
        if touch:
            for n in reversed(path):  # ancestors end most recent, so leaves go first
                self._lru.move_to_end(id(n))
        return Match(tokens, tuple(path))

    @property
    def available_tokens(self) -> int:
        """Tokens a new request can get: everything not locked and not reserved."""
        return self.capacity_tokens - self.locked_tokens - self.reserved_tokens

    # ---- running requests ----------------------------------------------------------------
    def lock(self, path: Sequence[_Node]) -> None:
        for n in path:
            if n.lock == 0:
                self.locked_tokens += n.num_tokens
            n.lock += 1

    def unlock(self, path: Sequence[_Node]) -> None:
        for n in path:
            n.lock -= 1
            if n.lock == 0:
                self.locked_tokens -= n.num_tokens

    def reserve(self, num_tokens: int) -> bool:
        """Reserve room for a request's new KV, evicting LRU leaves; False if it cannot fit."""
        if num_tokens > self.available_tokens:
            return False
        self.reserved_tokens += num_tokens
        self._evict(self.cached_tokens + self.reserved_tokens - self.capacity_tokens)
        return True

    def release(self, num_tokens: int) -> None:
        self.reserved_tokens -= num_tokens

    def insert(
        self, keys: Sequence[Hashable], lengths: Sequence[int], lock: bool, counted: int = 0
    ) -> tuple[tuple, int]:
        """Add a chain (reusing nodes that exist). Returns (path, tokens newly added); the
        caller releases its reservation for them. ``lock`` locks the whole path. An existing
        node gains a hit unless it is among the first ``counted`` keys, which this request
        inserted before (its prompt, when it inserts the finished sequence)."""
        node, path, added = self.root, [], 0
        for i, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, node, n)
                self._lru[id(child)] = child
                self.cached_tokens += n
                added += n
            elif i >= counted:
                child.hits += 1
            path.append(child)
            node = child
        for n in reversed(path):
            self._lru.move_to_end(id(n))
        if lock:
            self.lock(path)
        return tuple(path), added

    def trim(self) -> None:
        """Evict until the cache and the reservations fit the capacity."""
        self._evict(self.cached_tokens + self.reserved_tokens - self.capacity_tokens)

    def _evict(self, num_tokens: int) -> None:
        """Free at least ``num_tokens`` by removing unlocked leaves, oldest first; a parent
        becomes a candidate once its children are gone (it is always more recent than them).
        SLRU: unprotected leaves first (those that become leaves included), then the rest."""
        freed = 0
        segments = (0, 1) if self.eviction == SLRU else (1,)
        for ceiling in segments:
            while freed < num_tokens:
                victims: dict[int, _Node] = {}
                got = 0
                for node in self._lru.values():
                    # children are older than their parent, so a parent whose children are
                    # all victims already is the next leaf in LRU order
                    if (
                        node.lock == 0
                        and self._segment(node) <= ceiling
                        and all(id(ch) in victims for ch in node.children.values())
                    ):
                        victims[id(node)] = node
                        got += node.num_tokens
                        if freed + got >= num_tokens:
                            break
                if not victims:
                    break
                for node in victims.values():
                    del self._lru[id(node)]
                    del node.parent.children[node.key]
                    self.cached_tokens -= node.num_tokens
                freed += got
        self.num_evicted_tokens += freed

    def _segment(self, node: _Node) -> int:
        """SLRU's segment of a node: 1 protected (reused), 0 probationary; 0 under LRU."""
        return int(self.eviction == SLRU and node.hits >= SLRU_PROTECTED_HITS)

    def check_invariants(self) -> None:
        total = locked = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.key == key and child.parent is node
                assert id(child) in self._lru
                total += child.num_tokens
                locked += child.num_tokens if child.lock else 0
                assert child.lock >= 0
                stack.append(child)
        assert total == self.cached_tokens, (total, self.cached_tokens)
        assert locked == self.locked_tokens, (locked, self.locked_tokens)
        assert len(self._lru) == sum(1 for _ in self._iter_nodes())
        assert self.cached_tokens + self.reserved_tokens <= self.capacity_tokens

    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            for child in stack.pop().children.values():
                yield child
                stack.append(child)
