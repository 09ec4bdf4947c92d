"""KV memory (minikv/cache/blocks/pool.py): the paged KVPool and rung 2's RowPool, and swap through the pool."""
from __future__ import annotations

import pytest
import torch

from minikv.cache.blocks.pool import KV_LAYOUTS, KVPool, RowPool
from minikv.cache.blocks.swap import SwapSpace

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 8, 4, 2, 3


def filled_pool(kv_layout: str, seed: int = 0) -> KVPool:
    """A pool whose every value is distinct, so a copy to the wrong place shows."""
    pool = KVPool(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", kv_layout)
    g = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.randn(pool.k_cache.shape, generator=g))
    pool.v_cache.copy_(torch.randn(pool.v_cache.shape, generator=g))
    return pool


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_the_pool_is_indexed_layer_block_slot_head_dim_in_either_storage_order(kv_layout):
    pool = KVPool(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", kv_layout)
    assert pool.k_cache.shape == pool.v_cache.shape == (LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    head_major = pool.k_cache.stride(3) > pool.k_cache.stride(2)  # heads further apart than slots
    assert head_major == (kv_layout == "hnd")
    assert pool.block_bytes == 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
    assert pool.block_bytes == KVPool.bytes_per_block(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)
    assert KVPool.bytes_per_block(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16) == pool.block_bytes // 2
    with pytest.raises(ValueError, match="kv_layout"):
        KVPool(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu", "hdn")


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_store_writes_each_token_into_its_slot_in_one_layer_only(kv_layout):
    pool = filled_pool(kv_layout)
    before_k, before_v = pool.k_cache.clone(), pool.v_cache.clone()
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5, 17, 30])  # (block 1, offset 1), (4, 1), (7, 2)
    pool.store(1, k, v, slots)
    for t, (b, o) in enumerate([(1, 1), (4, 1), (7, 2)]):
        assert torch.equal(pool.k_cache[1, b, o], k[t]) and torch.equal(pool.v_cache[1, b, o], v[t])
        before_k[1, b, o], before_v[1, b, o] = k[t], v[t]
    assert torch.equal(pool.k_cache, before_k) and torch.equal(pool.v_cache, before_v)  # nothing else moved


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_copy_blocks_gives_each_destination_its_source_in_every_layer(kv_layout):
    pool = filled_pool(kv_layout)
    want_k, want_v = pool.k_cache.clone(), pool.v_cache.clone()
    pairs = [(1, 6), (3, 2), (1, 7)]  # one source copied twice
    pool.copy_blocks(pairs)
    for src, dst in pairs:
        want_k[:, dst], want_v[:, dst] = want_k[:, src], want_v[:, src]
    assert torch.equal(pool.k_cache, want_k) and torch.equal(pool.v_cache, want_v)
    pool.copy_blocks([])  # nothing to copy is not an error
    assert torch.equal(pool.k_cache, want_k)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_read_then_write_blocks_round_trips_between_blocks_and_layouts(kv_layout):
    pool = filled_pool(kv_layout)
    k, v = pool.read_blocks([5, 0, 3])
    assert k.shape == (LAYERS, 3, BLOCK_SIZE, KV_HEADS, HEAD_DIM) and k.is_contiguous()
    assert torch.equal(k[:, 1], pool.k_cache[:, 0]) and torch.equal(v[:, 2], pool.v_cache[:, 3])
    k_copy = k.clone()
    pool.k_cache[:, 5] = 0  # read_blocks returned a copy, not a view
    assert torch.equal(k, k_copy)
    other = KVPool(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu",
                   "nhd" if kv_layout == "hnd" else "hnd")
    other.write_blocks([2, 4, 6], k, v)
    assert torch.equal(other.k_cache[:, 2], k[:, 0]) and torch.equal(other.v_cache[:, 6], v[:, 2])
    assert not other.k_cache[:, [0, 1, 3, 5, 7]].any()  # the other blocks untouched
    with pytest.raises(ValueError, match="write_blocks of 2 blocks"):
        other.write_blocks([0, 1], k, v)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_swap_out_and_back_in_through_the_pool_restores_the_blocks(kv_layout):
    pool = filled_pool(kv_layout, seed=4)
    saved_k, saved_v = pool.k_cache[:, [2, 5]].clone(), pool.v_cache[:, [2, 5]].clone()
    swap = SwapSpace(pool, num_cpu_blocks=3)
    assert swap.bytes_per_block == pool.block_bytes
    cpu = swap.swap_out([2, 5])
    assert swap.num_free_blocks == 1 and swap.blocks_out == 2
    pool.k_cache.zero_()  # the device blocks are reused by someone else meanwhile
    pool.v_cache.zero_()
    swap.swap_in(cpu, [7, 1])  # back into other blocks
    assert torch.equal(pool.k_cache[:, [7, 1]], saved_k) and torch.equal(pool.v_cache[:, [7, 1]], saved_v)
    assert swap.num_free_blocks == 3 and swap.blocks_in == 2


def test_row_pool_hands_out_each_row_once_and_refuses_a_double_free():
    rows = RowPool(LAYERS, 2, 16, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    assert rows.k_cache.shape == (LAYERS, 2, 16, KV_HEADS, HEAD_DIM)
    assert rows.bytes_reserved == 2 * LAYERS * 2 * 16 * KV_HEADS * HEAD_DIM * 4
    a, b = rows.allocate_row(), rows.allocate_row()
    assert {a, b} == {0, 1}
    with pytest.raises(RuntimeError, match="all 2 cache rows are in use"):
        rows.allocate_row()
    rows.free_row(a)
    with pytest.raises(RuntimeError, match=f"cache row {a} freed twice"):
        rows.free_row(a)
    with pytest.raises(ValueError, match="cache row 5 does not exist"):
        rows.free_row(5)
    assert rows.allocate_row() == a


def test_move_row_copies_a_whole_row_in_every_layer():
    rows = RowPool(LAYERS, 3, 5, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    rows.k_cache.normal_()
    rows.v_cache.normal_()
    want_k, want_v = rows.k_cache[:, 2].clone(), rows.v_cache[:, 2].clone()
    rows.move_row(2, 0)
    assert torch.equal(rows.k_cache[:, 0], want_k) and torch.equal(rows.v_cache[:, 0], want_v)
