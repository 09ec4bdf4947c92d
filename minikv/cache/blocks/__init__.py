"""Blocks of KV memory and who holds them (rungs 4-9):

    pool.py         KVPool (the tensors, block by block; copies, reads and writes of blocks), RowPool
    quant.py        quantized storage: int8 / fp8 blocks with per token and head scales
    allocator.py    who hands out free block ids (BlockAllocator, FreeListAllocator, CachingAllocator)
    block_table.py  what a request is to the cache (CachedRequest), blocks_needed, slot_mapping
    swap.py         CPU swap space for preempted requests
    window.py       which blocks a sliding window gives back
    table_rows.py   the batch's block tables as one array, rewritten only where a table changed
"""
