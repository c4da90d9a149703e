"""BlockPool and KVCacheManager without a model."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockPool, KVCacheManager, hash_block_tokens
from engine.request import Request, SamplingParams

BS = 4


def make_request(req_id: str, token_ids: list[int]) -> Request:
    return Request(req_id, token_ids, SamplingParams(max_tokens=8), eos_token_id=None)


def assert_all_free(manager: KVCacheManager) -> None:
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free_block_queue.block_ids()) == list(range(pool.num_blocks))


def test_chained_hash_depends_on_parent():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(a, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_free_queue_remove_from_middle_and_lru_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks([blocks[3], blocks[1], blocks[4], blocks[0], blocks[2]])
    assert pool.free_block_queue.block_ids() == [3, 1, 4, 0, 2]
    pool.touch([blocks[4]])  # a hit on a free block takes it out of the middle
    assert pool.free_block_queue.block_ids() == [3, 1, 0, 2]
    assert pool.get_new_blocks(2) == [blocks[3], blocks[1]]
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_allocation_on_demand_wastes_only_the_last_block():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert len(manager.allocate_slots(req, 10)) == 3  # 10 tokens -> 3 blocks of 4
    req.num_computed_tokens = 10
    req.append_output_token_ids([100])
    assert manager.allocate_slots(req, 1) == []  # token 11 fits the last block
    req.num_computed_tokens = 11
    req.append_output_token_ids([101, 102])
    assert len(manager.allocate_slots(req, 2)) == 1
    assert len(manager.get_block_ids("a")) == 4
    manager.free(req)
    assert_all_free(manager)


def test_allocate_returns_none_without_side_effects():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    assert manager.allocate_slots(a, 8) is not None
    b = make_request("b", list(range(100, 108)))
    assert manager.allocate_slots(b, 8) is None
    assert manager.get_block_ids("b") == []
    assert manager.block_pool.get_num_free_blocks() == 1
    manager.free(a)
    manager.free(b)
    assert_all_free(manager)


def test_prefix_hit_covers_full_blocks_and_never_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_request("a", prompt)
    assert manager.get_computed_blocks(a) == ([], 0)
    manager.allocate_slots(a, 12)
    a.num_computed_tokens = 12

    b = make_request("b", prompt)  # same 12 tokens: the last must be recomputed
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in blocks] == manager.get_block_ids("a")[:2]

    c = make_request("c", [*prompt[:10], 99, 98, 97])  # diverges inside block 2
    blocks, num_hit = manager.get_computed_blocks(c)
    assert num_hit == 8
    manager.allocate_slots(c, 13 - 8, blocks)
    assert manager.get_block_ids("c")[:2] == manager.get_block_ids("a")[:2]
    assert manager.block_pool.blocks[manager.get_block_ids("a")[0]].ref_cnt == 2

    d = make_request("d", [7, *prompt[1:]])  # differs in block 0: chained hashes all miss
    assert manager.get_computed_blocks(d) == ([], 0)
    for r in (a, c):
        manager.free(r)
    assert_all_free(manager)


def test_cached_free_blocks_are_reused_then_evicted_lru():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)  # 3 blocks, 2 full (cached)
    a.num_computed_tokens = 9
    ids_a = manager.get_block_ids("a")
    manager.free(a)
    # Freed tail first: the partial last block is evicted first, the first block last.
    assert manager.block_pool.free_block_queue.block_ids() == [3, ids_a[2], ids_a[1], ids_a[0]]

    b = make_request("b", list(range(9)))
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in blocks] == ids_a[:2]
    manager.allocate_slots(b, 1, blocks)
    assert manager.get_block_ids("b")[:2] == ids_a[:2]
    manager.free(b)

    e = make_request("e", list(range(50, 66)))  # needs all 4 blocks: every cached hash evicted
    manager.allocate_slots(e, 16)
    assert manager.block_pool.cached_block_hash_to_block.keys() == {h for h in e.block_hashes[:4]}
    manager.free(e)
    assert_all_free(manager)


def test_hit_on_free_blocks_counts_against_room():
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    manager.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    manager.free(a)  # 3 free blocks, 2 of them cached hits for b
    b = make_request("b", [*list(range(8)), 40, 41, 42, 43, 44])
    blocks, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # b needs 2 more blocks; only 1 is free once its 2 hits are referenced.
    assert manager.allocate_slots(b, 5, blocks) is None
    assert all(x.ref_cnt == 0 for x in blocks)
    assert manager.allocate_slots(b, 4, blocks) is not None
    manager.free(b)
    assert_all_free(manager)


def test_double_free_is_caught():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])
