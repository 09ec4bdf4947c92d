"""CPU swap space: where a preempted sequence's KV blocks wait instead of being recomputed.

    device pool  k_cache[:, block]  --swap out-->  cpu pool  k_swap[:, cpu_block]
                                    <--swap in---
Costs bytes over the host link instead of FLOPs; pays off when re-prefilling is expensive.
"""
from __future__ import annotations

import torch

from minikv.cache.allocator import FreeListAllocator


class SwapSpace:
    def __init__(self, backend, num_cpu_blocks: int):
        if num_cpu_blocks < 0:
            raise ValueError(f"swap space needs num_cpu_blocks >= 0, got {num_cpu_blocks}")
        self.backend = backend
        pin = backend.k_cache.is_cuda
        shape = (backend.k_cache.shape[0], num_cpu_blocks, *backend.k_cache.shape[2:])
        self.k_swap = torch.zeros(shape, dtype=backend.k_cache.dtype, pin_memory=pin)
        self.v_swap = torch.zeros(shape, dtype=backend.v_cache.dtype, pin_memory=pin)
        self.allocator = FreeListAllocator(num_cpu_blocks)
        self.bytes_per_block = 2 * backend.k_cache[:, 0].numel() * backend.k_cache.element_size()  # K+V, all layers
        self.blocks_out = self.blocks_in = 0

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        cpu = [self.allocator.allocate() for _ in device_blocks]
        src = torch.tensor(device_blocks, device=self.backend.k_cache.device)
        self.k_swap[:, cpu] = self.backend.k_cache[:, src].to("cpu")
        self.v_swap[:, cpu] = self.backend.v_cache[:, src].to("cpu")
        self.blocks_out += len(cpu)
        return cpu

    def swap_in(self, cpu_blocks: list[int], device_blocks: list[int]) -> None:
        dst = torch.tensor(device_blocks, device=self.backend.k_cache.device)
        self.backend.k_cache[:, dst] = self.k_swap[:, cpu_blocks].to(self.backend.k_cache.device)
        self.backend.v_cache[:, dst] = self.v_swap[:, cpu_blocks].to(self.backend.v_cache.device)
        self.release(cpu_blocks)
        self.blocks_in += len(cpu_blocks)

    def release(self, cpu_blocks: list[int]) -> None:
        for b in cpu_blocks:
            self.allocator.free(b)
