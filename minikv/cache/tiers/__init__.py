"""Rung 9: a tiered prefix store. Blocks the pool evicts are kept further down instead of dropped:

    pool (device)   the prefix cache's blocks                  a hit costs nothing
      | evict  ^ load
    CPU tier        pinned host memory, LRU within a budget    a hit costs a host-to-device copy
      | evict  ^ load
    disk tier       one file per block, LRU within a budget    a hit costs a file read + the copy
                    written through: queued once the block is computed and cached, so a new engine
                    (or one after a crash) finds it

    store.py        what a store is: BlockStore (the `kv_offload_store` seam), a block's Value
    identity.py     the store key: the weights' fingerprint, the pool's format, the model's identity
    cpu.py          CpuTier: a slab in host memory, LRU, moved in batches
    block_file.py   one block's file: header, payload, checksum
    disk_budget.py  the directory's budget: defaults, temporary files of dead writers
    disk.py         DiskTier: one file per block, a writer thread, reader threads
    tiered.py       TieredStore: the CPU tier above the disk tier
    offload.py      Offload: the seam between the hash chain and the store (lookup, spill, load)
    loading.py      TierLoads: the block manager's loads from the store, from start to admission
"""
