"""The paged KV cache's bookkeeping: blocks, their pool, and the per-request manager.

A block holds `block_size` tokens of KV for every layer. A request's block table maps its
logical block i (tokens [i*bs, (i+1)*bs)) to a physical block, allocated on demand, so only
each request's last block has unused slots. Full blocks are content-addressed by a chained
hash (parent hash + the block's token ids) so requests sharing a prefix share blocks; a
block nobody references stays cached in an LRU free queue until it is reused.

A request forked from another (`fork`, beam search) shares its parent's blocks by reference:
full blocks for good (they are never written again), the partly filled last block until one
of its sharers writes into it. That writer gets a fresh block, and the pair (shared, fresh) in
`blocks_to_copy`: the model runner copies the block's KV before the step's forward writes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.request import Request

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: equal hashes mean equal token prefixes (up to blake2b)."""
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and cached
    # Links of the free queue (None when the block is in use).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU at the head), O(1) removal anywhere.

    Removal from the middle is what a prefix-cache hit on a free (ref_cnt 0) block needs.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from the next to be evicted to the last (for tests and debugging)."""
        ids, block = [], self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """All physical blocks: ref counts, the hash -> block map of cached blocks, the LRU queue."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the LRU head, evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"asked for {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.uncache_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the queue tail in the given (eviction) order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget the block's content: no prefix-cache lookup finds it any more."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash. When an equal block is cached already (two
        requests computed the same prefix at once) the first stays the one that is shared."""
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block


class KVCacheManager:
    """Per-request block tables on top of the `BlockPool`, with prefix caching and stats."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already hashed
        # (source, destination) block ids of the copies on write made since the scheduler
        # last took them (`allocate_slots`)
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in full blocks, never covering its last token
        (its logits are needed). Returns the blocks (not yet referenced) and their tokens.

        None for a request asking for prompt logprobs: it needs every prompt position's logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` (+ lookahead) after the request's computed tokens.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, referenced here.
        Returns the newly allocated blocks, or None when the pool has no room: nothing changes
        then, and the scheduler decides whom to preempt. A shared block the step would write
        into is replaced by a copy in the request's table (not among the blocks returned:
        only a fork, new to the model runner, shares one) and queued in `blocks_to_copy`.
        """
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        )
        num_new_blocks, copy_on_write = self._num_blocks_to_take(
            request, num_new_tokens, new_computed_blocks, num_lookahead_tokens
        )
        first = num_computed_tokens // self.block_size
        # Hits sitting in the free queue stop being free once referenced.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + copy_on_write > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        if copy_on_write:
            shared, (copy,) = req_blocks[first], self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([shared])
            req_blocks[first] = copy
            self.blocks_to_copy.append((shared.block_id, copy.block_id))
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Blocks full of known tokens after this step are cached now: their KV is written in
            # this step's forward, before any other request of the step reads it.
            num_known = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, req_blocks, num_known // self.block_size)
        return new_blocks

    def _num_blocks_to_take(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> tuple[int, bool]:
        """The new blocks `allocate_slots` takes from the pool for these tokens, and whether
        it copies on write the block the step writes first (still shared with a fork)."""
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        )
        num_required_blocks = -(
            -(num_computed_tokens + num_new_tokens + num_lookahead_tokens) // self.block_size
        )
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        first = num_computed_tokens // self.block_size
        copy_on_write = num_new_tokens > 0 and first < len(req_blocks)
        return num_new_blocks, copy_on_write and req_blocks[first].ref_cnt > 1

    def can_allocate(self, request: Request, num_new_tokens: int, num_lookahead: int) -> bool:
        """Whether `allocate_slots(request, num_new_tokens)` would find room now, prefix hits
        not counted (they only need fewer blocks); changes nothing."""
        num_new_blocks, copy_on_write = self._num_blocks_to_take(
            request, num_new_tokens, (), num_lookahead
        )
        return num_new_blocks + copy_on_write <= self.block_pool.get_num_free_blocks()

    def fork(self, parent: Request, child: Request) -> int:
        """Give `child`, whose tokens begin with the parent's computed ones, the parent's
        blocks over them: one more reference each, the full blocks with their hashes. The
        partly filled last block stays shared until a sharer writes into it (copy on write,
        `allocate_slots`). Returns the tokens the child has computed: the parent's."""
        num_tokens = parent.num_computed_tokens
        blocks = self.req_to_blocks.get(parent.request_id, [])[: -(-num_tokens // self.block_size)]
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        num_full_blocks = num_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:num_full_blocks]
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_full_blocks
        )
        return num_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so that its last blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep the blocks of the request's id that hold its first `num_tokens` tokens and
        free the rest, tail first; returns the tokens the kept blocks hold (a session's next
        turn takes them over). A partly kept block is kept only while it has no hash: a
        cached block may be shared, and the slots past `num_tokens` will be written."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_kept = min(len(blocks), -(-num_tokens // self.block_size))
        if num_kept * self.block_size > num_tokens and blocks[num_kept - 1].block_hash is not None:
            num_kept -= 1
        self.block_pool.free_blocks(reversed(blocks[num_kept:]))
        del blocks[num_kept:]
        if request.request_id in self.num_cached_blocks:
            num_cached = self.num_cached_blocks[request.request_id]
            self.num_cached_blocks[request.request_id] = min(num_cached, num_kept)
        return min(num_tokens, num_kept * self.block_size)

    def uncache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Take out of the prefix cache the request's blocks past its first
        `num_computed_tokens` tokens: `allocate_slots` caches blocks before the step's forward
        writes their KV, so a step that failed leaves them cached without it."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[num_computed_tokens // self.block_size :]:
            self.block_pool.uncache_block(block)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_num_blocks_in_use(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()

    def _update_block_hashes(self, request: Request) -> None:
        num_full_blocks = request.num_tokens // self.block_size
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))

    def _cache_full_blocks(
        self, request: Request, req_blocks: list[KVCacheBlock], num_full_blocks: int
    ) -> None:
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request)
        for i in range(num_cached, num_full_blocks):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full_blocks
