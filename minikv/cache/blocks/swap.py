"""CPU swap space: where a preempted sequence's KV blocks wait instead of being recomputed.

    device KVPool  block          --swap out-->  cpu blocks  k_swap[:, cpu_block]
                   (read_blocks)  <--swap in---  (write_blocks)
Costs bytes over the host link instead of FLOPs; pays off when re-prefilling is expensive.
A quantized pool's blocks travel as they are stored (8-bit values, their scales and int8's zero
points): nothing is re-quantized, and about half the bytes of a 16-bit pool cross the link.
"""
from __future__ import annotations

import torch

from minikv.cache.blocks.allocator import FreeListAllocator
from minikv.cache.blocks.pool import KVPool


class SwapSpace:
    def __init__(self, pool: KVPool, num_cpu_blocks: int):
        if num_cpu_blocks < 0:
            raise ValueError(f"swap space needs num_cpu_blocks >= 0, got {num_cpu_blocks}")
        self.pool = pool
        # each of the pool's planes with num_cpu_blocks blocks, pinned for fast copies from a GPU:
        # [num_layers, num_cpu_blocks, block_size, num_kv_heads, head_dim] for K and V (scales: no head_dim)
        pin = pool.device.type == "cuda"
        self.planes = [torch.zeros((p.shape[0], num_cpu_blocks, *p.shape[2:]), dtype=p.dtype, pin_memory=pin)
                       for p in pool.planes]
        self.k_swap, self.v_swap = self.planes[0], self.planes[1]
        self.allocator = FreeListAllocator(num_cpu_blocks)
        self.bytes_per_block = pool.block_bytes  # K+V, all layers
        self.blocks_out = self.blocks_in = 0

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Copy these pool blocks to free CPU blocks; returns the CPU blocks, in the same order. An
        entry of -1 (a block a sliding window gave back) stays -1: nothing to copy."""
        cpu = [self.allocator.allocate() if b >= 0 else -1 for b in device_blocks]
        pairs = [(d, c) for d, c in zip(device_blocks, cpu) if d >= 0]
        if pairs:
            for swap, plane in zip(self.planes, self.pool.read_blocks([d for d, _ in pairs])):
                swap[:, [c for _, c in pairs]] = plane.to("cpu")
        self.blocks_out += len(pairs)
        return cpu

    def swap_in(self, cpu_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy CPU blocks back into these pool blocks and free the CPU blocks (-1 entries: none)."""
        pairs = [(c, d) for c, d in zip(cpu_blocks, device_blocks) if c >= 0]
        if pairs:
            cpu = [c for c, _ in pairs]
            self.pool.write_blocks([d for _, d in pairs], *(swap[:, cpu] for swap in self.planes))
        self.release(cpu_blocks)
        self.blocks_in += len(pairs)

    def release(self, cpu_blocks: list[int]) -> None:
        for b in cpu_blocks:
            if b >= 0:
                self.allocator.free(b)

    def close(self) -> None:
        """Give the CPU memory back (the engine is closed)."""
        self.planes, self.k_swap, self.v_swap = [], None, None

    def reset(self) -> None:
        """Forget every swapped-out block (after a fault, the engine recomputes their sequences)."""
        self.allocator = FreeListAllocator(self.allocator.num_blocks)
