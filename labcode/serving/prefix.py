"""Prefix caching two ways, over one `BlockPool`: vLLM's chained block hashes and SGLang's radix tree.

Introduced in chapter 11 (serving). Both answer the scheduler's four questions:
`match` (which cached blocks start this sequence; takes a reference to each), `store` (after a
step: remember what is now computed), `release` (the request leaves: drop its references) and
`evict` (free at least n blocks). A block's reference count is the number of block tables that
hold it, plus one while the radix tree holds it (`held`). vLLM names full blocks by hashes kept in
the pool itself (`BlockPool.register`, chapter 9): a cached block with no reference waits in the
free list, and handing it out again evicts it, least recently freed first. SGLang's tree owns its
blocks, locks the path a running request uses, and evicts unlocked leaves, least recently used first.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter

from labcode.checks import fail
from labcode.engines.paged import BlockPool, block_hashes


def salted_hashes(ids: list[int], block_size: int, salt: str | None = None) -> list[str]:
    """One hash per full block of `ids` [N] (chapter 9's chain), mixed with a tenant's `salt`: with different
    salts no two sequences share a hash, since every block's hash covers the first block's."""
    if not (salt is None or isinstance(salt, str)):
        fail("salt", "None or a string", type(salt).__name__)
    hashes = block_hashes(list(ids), block_size)
    if salt is None:
        return hashes
    return [hashlib.sha256(repr((salt, h)).encode()).hexdigest()[:16] for h in hashes]


class HashPrefixCache:
    """vLLM's automatic prefix caching: full computed blocks registered under their salted chained hash."""

    name = "hash"

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            fail("pool", "a BlockPool", type(pool).__name__)
        self.pool = pool

    def match(self, tokens: list[int], salt: str | None) -> tuple[list[int], None]:
        """The cached blocks of the longest run of full blocks of tokens[:-1] (the last token is always computed:
        its logits are needed), one reference taken on each."""
        hits = []
        for h in salted_hashes(tokens[:-1], self.pool.block_size, salt):
            if h not in self.pool.cached:
                break
            hits.append(self.pool.cached[h])
        for block in hits:
            self.pool.touch(block)
        return hits, None

    def store(self, tokens: list[int], blocks: list[int], n_cached: int, salt: str | None,
              handle: None) -> tuple[list[int], None]:
        """Register the full blocks among the first `n_cached` computed tokens (the first block per hash wins);
        the block table stays as it is (vLLM's is append-only)."""
        for block, h in zip(blocks, salted_hashes(tokens[:n_cached], self.pool.block_size, salt), strict=False):
            self.pool.register(block, h)
        return blocks, None

    def release(self, tokens: list[int], blocks: list[int], n_cached: int, salt: str | None, handle: None) -> None:
        """Drop the request's references, its last block first, so a cached prefix is evicted from its end."""
        self.store(tokens, blocks, n_cached, salt, handle)
        for block in reversed(blocks):
            self.pool.decref(block)

    def evictable(self) -> int:
        """Blocks evict() could free beyond the free list: none here."""
        return 0  # cached blocks without a reference already sit in the free list

    def evict(self, n: int) -> None:
        """Nothing to do: `BlockPool.take` evicts a cached free block when it hands it out."""

    def held(self) -> Counter:
        """References the cache itself holds, per block: none (the pool's hash table holds no reference)."""
        return Counter()

    def check(self, running: list[tuple[None, list[int]]]) -> None:
        """The hash table is a bijection between cached hashes and blocks."""
        pool = self.pool
        if not (len(pool.cached) == len(pool.hash_of) and all(pool.cached[h] == b for b, h in pool.hash_of.items())):
            fail("prefix cache", "hash_of and cached inverse to each other", (pool.hash_of, pool.cached),
                 AssertionError)


class Node:
    """A radix-tree edge: `tokens` (whole pages) held in `blocks` (one per page), `locks` running users."""

    def __init__(self, tokens: tuple, blocks: list[int], parent: Node | None, stamp: int) -> None:
        self.tokens, self.blocks, self.parent, self.stamp = tokens, blocks, parent, stamp
        self.children: dict[tuple, Node] = {}
        self.locks = 0


class RadixPrefixCache:
    """SGLang's radix cache over pool blocks: a tree per salt, edges split at page boundaries, one pool reference
    per block held, reference counts (`locks`) on the path each running request matched, LRU eviction of leaves."""

    name = "radix"

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            fail("pool", "a BlockPool", type(pool).__name__)
        self.pool, self.roots, self.clock = pool, {}, 0

    def _key(self, tokens: tuple) -> tuple:
        return tuple(tokens[: self.pool.block_size])

    def _walk(self, tokens: list[int], salt: str | None) -> tuple[Node, int]:
        """The deepest node whose path is a prefix of `tokens` (splitting an edge matched part way), and its length."""
        self.clock += 1
        bs, node, n = self.pool.block_size, self.roots.setdefault(salt, Node((), [], None, 0)), 0
        while n + bs <= len(tokens) and (child := node.children.get(self._key(tuple(tokens[n:])))):
            same = 0
            while same < min(len(child.tokens), len(tokens) - n) and child.tokens[same] == tokens[n + same]:
                same += 1
            same -= same % bs  # whole pages only
            child.stamp = self.clock
            if same < len(child.tokens):
                return self._split(child, same), n + same
            node, n = child, n + same
        return node, n

    def _split(self, node: Node, m: int) -> Node:
        """Cut `node`'s edge after m tokens; the upper part becomes a new node with the same locks."""
        upper = Node(node.tokens[:m], node.blocks[: m // self.pool.block_size], node.parent, node.stamp)
        upper.locks = node.locks
        node.parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[m:], node.blocks[m // self.pool.block_size :], upper
        upper.children[self._key(node.tokens)] = node
        return upper

    def _path(self, node: Node) -> list[Node]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    def match(self, tokens: list[int], salt: str | None) -> tuple[list[int], Node]:
        """The blocks of the longest cached run of whole pages of tokens[:-1]; the path is locked and a
        reference taken on each block. Returns (blocks, the node to unlock on release)."""
        bs = self.pool.block_size
        node, _ = self._walk(tokens[: (len(tokens) - 1) // bs * bs], salt)
        path = self._path(node)
        blocks = [b for used in path for b in used.blocks]
        for used in path:
            used.locks += 1
        for block in blocks:
            self.pool.incref(block)
        return blocks, node

    def store(self, tokens: list[int], blocks: list[int], n_cached: int, salt: str | None,
              handle: Node) -> tuple[list[int], Node]:
        """Insert the request's computed whole pages (after each chunk, as SGLang caches unfinished requests);
        where the tree already had a page, the request's table takes the tree's block and gives its own copy
        back. The request now locks the path to its last page. Returns (its new table, the node it locks)."""
        bs = self.pool.block_size
        full = n_cached // bs * bs
        node, n = self._walk(tokens[:full], salt)
        if n < full:
            child = Node(tuple(tokens[n:full]), blocks[n // bs : full // bs], node, self.clock)
            node.children[self._key(child.tokens)] = child
            for block in child.blocks:
                self.pool.incref(block)
            node = child
        path = self._path(node)
        tree_blocks = [b for used in path for b in used.blocks]
        for mine, theirs in zip(blocks, tree_blocks, strict=False):
            if mine != theirs:  # same tokens, same positions: the same keys and values up to rounding
                self.pool.incref(theirs)
                self.pool.decref(mine)
        for used in path:
            used.locks += 1
        for used in self._path(handle):
            used.locks -= 1
        return tree_blocks + blocks[full // bs :], node

    def release(self, tokens: list[int], blocks: list[int], n_cached: int, salt: str | None, handle: Node) -> None:
        """Store what the request computed, unlock its path and drop the request's references."""
        blocks, handle = self.store(tokens, blocks, n_cached, salt, handle)
        for used in self._path(handle):
            used.locks -= 1
        for block in reversed(blocks):
            self.pool.decref(block)

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evictable(self) -> int:
        """Blocks held only by the tree: those of unlocked nodes."""
        return sum(len(n.blocks) for n in self._nodes() if n.locks == 0)

    def evict(self, n: int) -> None:
        """Free at least n blocks (when that many are evictable): unlocked leaves, least recently used first."""
        leaves = [(x.stamp, id(x), x) for x in self._nodes() if x.parent and not x.children and x.locks == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < n and leaves:
            _, _, node = heapq.heappop(leaves)
            for block in reversed(node.blocks):
                self.pool.decref(block)
            freed += len(node.blocks)
            parent = node.parent
            del parent.children[self._key(node.tokens)]
            if parent.parent and not parent.children and parent.locks == 0:
                heapq.heappush(leaves, (parent.stamp, id(parent), parent))

    def held(self) -> Counter:
        """References the tree holds, per block: one for each block of each node."""
        return Counter(b for n in self._nodes() for b in n.blocks)

    def check(self, running: list[tuple[Node, list[int]]]) -> None:
        """Edges are whole pages, keyed by their first page; locks equal the running requests through each node;
        each running request's (handle, table) starts with the blocks of the path it locks."""
        bs, users = self.pool.block_size, Counter(id(n) for h, _ in running for n in self._path(h))
        for handle, table in running:
            path = [b for n in self._path(handle) for b in n.blocks]
            if table[: len(path)] != path:
                fail("radix tree", "a running request's table starting with its locked path", (table, path),
                     AssertionError)
        for node in self._nodes():
            if node.parent is None:
                continue
            ok = (len(node.tokens) > 0 and len(node.tokens) == bs * len(node.blocks)
                  and node.parent.children.get(self._key(node.tokens)) is node and node.locks == users[id(node)])
            if not ok:
                fail("radix tree", "whole-page edges under their key, locks = running users",
                     (node.tokens, node.blocks, node.locks, users[id(node)]), AssertionError)
