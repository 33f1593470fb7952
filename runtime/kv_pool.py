"""The KV pool's bookkeeping: which blocks are free, who holds them, which hold a known prefix.

The pool's memory belongs to the backend (one array per KV state, `n_blocks` blocks of
`block` positions); this class only hands out block ids. A block holds `block` consecutive
positions of one or more sequences:

- **Reference counts.** A sequence holds each block of its table once; a block whose count
  falls to 0 goes to the free list, oldest first out.
- **Prefix caching.** A full block is known by a hash of every token up to its end (a chain:
  the hash of the block before it and its own tokens), published once its positions are
  computed. A new sequence whose prompt starts with published blocks takes them (count + 1)
  instead of computing them; a freed block keeps its hash until it is handed out again, so a
  system prompt stays cached while the pool has room (least recently freed goes first). Only
  whole blocks are shared and a sequence writes only positions past its shared ones, so a
  shared block is never written.
- **Reservations.** A sequence is admitted only if every block it may need (prompt plus
  max_tokens) can be promised to it: `reserve()` counts them against the free list, and the
  sequence's allocations draw on its promise. So a running sequence never lacks a block, and
  a request that cannot be promised its blocks waits for others to finish instead of failing
  mid-stream.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

from hipc.base.errors import HipcError


def block_hashes(tokens: Sequence[int], block: int, parent: bytes = b"") -> list[bytes]:
    """The chained hash of each full block of `tokens` (16-byte BLAKE2b: a collision would
    silently share the wrong keys, so not Python's 64-bit hash)."""
    out = []
    for i in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens[i : i + block]))
        parent = h.digest()
        out.append(parent)
    return out


class KVPool:
    def __init__(self, n_blocks: int, block: int, caching: bool = True) -> None:
        if n_blocks < 1:
            raise HipcError("the KV pool needs at least one block")
        self.n_blocks, self.block, self.caching = n_blocks, block, caching
        self.refs = [0] * n_blocks
        # free blocks, least recently freed first; a cached one keeps its hash until reused
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(n_blocks)
        )
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.reserved = 0
        # prefix-cache accounting (for the hit rate): prompt tokens looked up, and found
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -------------------------------------------------------------- counts

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.n_blocks - len(self._free)

    @property
    def free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are handed out when needed)."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Blocks with a published prefix hash (held or free)."""
        return len(self._hash_of)

    @property
    def available(self) -> int:
        """Blocks that may still be promised."""
        return len(self._free) - self.reserved

    # -------------------------------------------------------------- prefix cache

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The published blocks of the longest prefix of `hashes`."""
        found = []
        if self.caching:
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                found.append(b)
        return found

    def publish(self, block_id: int, h: bytes) -> None:
        """Block `block_id` now holds the positions hashed `h` (computed): later prompts may
        share it. If another block already holds them, this one stays private."""
        if self.caching and h not in self._by_hash and block_id not in self._hash_of:
            self._by_hash[h] = block_id
            self._hash_of[block_id] = h

    # -------------------------------------------------------------- admission

    def admit(self, hits: Sequence[int], fresh: int) -> bool:
        """Take the shared blocks `hits` and promise `fresh` more, if the pool can; False
        (nothing taken) if it cannot. A hit that sat in the free list stops counting as free,
        so it is charged against what may be promised."""
        idle = sum(1 for b in hits if self.refs[b] == 0)
        if fresh + idle > self.available:
            return False
        for b in hits:
            self._take(b)
        self.reserved += fresh
        return True

    def allocate(self) -> int:
        """A fresh block drawn on a promise (the least recently freed; its old hash dropped)."""
        if self.reserved < 1 or not self._free:
            raise HipcError("KV pool: a block was allocated without a reservation")
        b, _ = self._free.popitem(last=False)
        h = self._hash_of.pop(b, None)
        if h is not None:
            del self._by_hash[h]
        self.refs[b] = 1
        self.reserved -= 1
        return b

    def unreserve(self, n: int) -> None:
        """Give back promised blocks a sequence did not use."""
        self.reserved -= n

    def release(self, block_id: int) -> None:
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            self._free[block_id] = None
        elif self.refs[block_id] < 0:
            raise HipcError(f"KV pool: block {block_id} released more often than taken")

    def _take(self, block_id: int) -> None:
        if self.refs[block_id] == 0:
            del self._free[block_id]
        self.refs[block_id] += 1
