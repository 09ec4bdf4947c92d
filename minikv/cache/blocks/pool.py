"""KV memory: the tensors that hold every layer's keys and values, and the copies between them.

Two pools, one per way of laying requests out (the attention backends read and write them, the
scheduler and the block manager decide who owns which part; nobody else holds the tensors):

    RowPool  (rung 2)  one preallocated row of max_len positions per request
        k_cache: [num_layers, num_rows, max_len, num_kv_heads, head_dim]        (v_cache the same)
        row r:  [0, seq_len)        filled: prompt, then one token per decode step
                [seq_len, max_len)  reserved for this request whether it is ever used or not

    KVPool   (rung 4)  fixed-size blocks shared by every request through block tables
        k_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]   (v_cache the same)
        slot s = block s // block_size, offset s % block_size

    Storage order of a KVPool (kv_layout), the same indexing either way:
      "nhd"  token-major: a slot's kv_heads x head_dim values side by side (one row per token)
      "hnd"  head-major: each KV head's block_size x head_dim values side by side (stored as
             [layers, blocks, kv_heads, block_size, head_dim], seen through a transposed view), so a
             kernel reading one KV head streams whole blocks instead of rows num_kv_heads apart

A quantized KVPool (cache_dtype int8 or float8_e4m3fn, see minikv/cache/blocks/quant.py) stores 8-bit
K/V and one float32 scale per token and KV head beside them, and for int8 one float32 zero point
too (x ~ q * scale + zero), token-major whatever the layout:
        k_scale: [num_layers, num_blocks, block_size, num_kv_heads]              (v_scale the same)
        k_zero:  [num_layers, num_blocks, block_size, num_kv_heads]  int8 only   (v_zero the same)
`store` quantizes, the attention backends dequantize what they read.

Whole blocks move through `copy_blocks` (copy-on-write), `read_blocks` / `write_blocks` (swap to the
CPU and back, and any other tier that keeps blocks elsewhere); on a quantized pool the scales and
zero points move with them (every tensor of `planes`).
"""
from __future__ import annotations

import torch

from minikv.cache.blocks.quant import QMAX, Quantizer, has_zero_point, quantize_block

KV_LAYOUTS = ("nhd", "hnd")


def new_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device, kv_layout: str = "nhd") -> torch.Tensor:
    """A zeroed tensor indexed [layer, block, slot, kv_head, dim], stored in kv_layout's order."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout {kv_layout!r} is not one of {KV_LAYOUTS}")
    if kv_layout == "hnd":
        stored = torch.zeros(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        return stored.transpose(2, 3)
    return torch.zeros(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


class KVPool:
    """The paged pool: K and V of `num_blocks` blocks of `block_size` slots, in every layer.

    dtype is the model's (what goes in and what attention computes in); cache_dtype what is stored:
    dtype itself (None), or int8 / float8_e4m3fn with scales. `quantizer` replaces `quantize_block`
    (the kv_quantizer seam)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, kv_layout: str = "nhd", cache_dtype: torch.dtype | None = None,
                 quantizer: Quantizer | None = None):
        cache_dtype = cache_dtype or dtype
        self.k_cache = new_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device,
                                kv_layout)
        self.v_cache = new_pool(num_layers, num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device,
                                kv_layout)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device, self.kv_layout = dtype, self.k_cache.device, kv_layout
        self.cache_dtype = cache_dtype
        self.k_scale = self.v_scale = self.k_zero = self.v_zero = None
        shape = (num_layers, num_blocks, block_size, num_kv_heads)
        if self.quantized:
            self.k_scale = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.v_scale = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.has_zero_point:
            self.k_zero = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.v_zero = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.quantizer = quantizer or quantize_block

    @property
    def quantized(self) -> bool:
        return self.cache_dtype in QMAX

    def close(self) -> None:
        """Give the memory back (the engine is closed): the tensors go, the sizes stay (stats())."""
        self.k_cache = self.v_cache = self.k_scale = self.v_scale = self.k_zero = self.v_zero = None

    @property
    def has_zero_point(self) -> bool:
        return has_zero_point(self.cache_dtype)

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        """Every tensor indexed [layer, block, ...]: (k, v), then (k_scale, v_scale) when quantized, then
        (k_zero, v_zero) when int8."""
        extra = (self.k_scale, self.v_scale) if self.quantized else ()
        extra += (self.k_zero, self.v_zero) if self.has_zero_point else ()
        return (self.k_cache, self.v_cache, *extra)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one block over all layers, scales and zero points included (static: sizes a pool
        before it exists)."""
        per_row = (head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype in QMAX else 0)
                   + (4 if has_zero_point(dtype) else 0))
        return 2 * num_layers * block_size * num_kv_heads * per_row

    @property
    def block_bytes(self) -> int:
        """K and V of one of this pool's blocks over all layers (scales and zero points included)."""
        return self.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                    self.cache_dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers (scales and zero points included)."""
        return self.block_bytes // self.block_size

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V: [num_blocks, block_size, num_kv_heads, head_dim] views (what kernels take)."""
        return self.k_cache[layer], self.v_cache[layer]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's K and V scales [num_blocks, block_size, num_kv_heads] (None, None when not quantized)."""
        if not self.quantized:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def layer_zeros(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One layer's K and V zero points [num_blocks, block_size, num_kv_heads] (None, None but on int8)."""
        if not self.has_zero_point:
            return None, None
        return self.k_zero[layer], self.v_zero[layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write K/V [T, num_kv_heads, head_dim] of one layer into their slots (every slot >= 0),
        quantized with their scales (and zero points) on a quantized pool."""
        block, offset = slot_mapping // self.block_size, slot_mapping % self.block_size
        if self.quantized:
            (k, ks, kz), (v, vs, vz) = self._quantize(k), self._quantize(v)
            self.k_scale[layer][block, offset] = ks.float()
            self.v_scale[layer][block, offset] = vs.float()
            if self.has_zero_point:
                self.k_zero[layer][block, offset] = kz.float()
                self.v_zero[layer][block, offset] = vz.float()
        self.k_cache[layer][block, offset] = k
        self.v_cache[layer][block, offset] = v

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The quantizer's (q, scale, zero) for x [T, num_kv_heads, head_dim], its shapes checked."""
        out = self.quantizer(x, self.cache_dtype)
        rows = tuple(x.shape[:-1])
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError(f"a kv_quantizer returns (q, scale, zero); got {type(out).__name__} of "
                             f"{len(out) if isinstance(out, tuple) else 1}")
        q, scale, zero = out
        if tuple(scale.shape) != rows or (zero is None) == self.has_zero_point or (
                zero is not None and tuple(zero.shape) != rows):
            raise ValueError(f"a kv_quantizer gives one scale per token and KV head {rows}, and "
                             f"{'a zero point of the same shape' if self.has_zero_point else 'zero None'} on a "
                             f"{self.cache_dtype} pool; got scale {tuple(scale.shape)}, zero "
                             f"{None if zero is None else tuple(zero.shape)}")
        return q, scale, zero

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets block src's K and V (and scales, zero points) in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for plane in self.planes:
            plane[:, dst] = plane[:, src]

    def read_blocks(self, blocks: list[int]) -> tuple[torch.Tensor, ...]:
        """Copies of these blocks' K and V: [num_layers, len(blocks), block_size, num_kv_heads, head_dim]
        each, token-major whatever the pool's layout; a quantized pool adds its K and V scales (and an
        int8 pool its K and V zero points) [num_layers, len(blocks), block_size, num_kv_heads], in the
        order of `planes`. One index_select per tensor (on a CPU, many times faster than plane[:, index])."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return tuple(plane.index_select(1, index).contiguous() for plane in self.planes)

    def write_blocks(self, blocks: list[int], *planes: torch.Tensor) -> None:
        """Put tensors shaped as `read_blocks` returns them (any device) into these blocks: one indexed
        copy per tensor on a GPU; on a CPU one copy per run of consecutive blocks (the indexed copy has
        no memcpy path there and runs many times slower)."""
        expected = [(self.num_layers, len(blocks), *p.shape[2:]) for p in self.planes]
        if len(planes) != len(expected) or any(tuple(p.shape) != e for p, e in zip(planes, expected)):
            names = ("K, V, K scales, V scales, K zero points and V zero points" if self.has_zero_point
                     else "K, V, K scales and V scales" if self.quantized else "K and V")
            raise ValueError(f"write_blocks of {len(blocks)} blocks needs {names} shaped {expected}, "
                             f"got {[tuple(p.shape) for p in planes]}")
        given = [p.to(self.device, plane.dtype) for p, plane in zip(planes, self.planes)]
        if self.device.type != "cpu":
            index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            for plane, g in zip(self.planes, given):
                plane.index_copy_(1, index, g)
            return
        for block, j, n in runs(blocks, range(len(blocks))):
            for plane, g in zip(self.planes, given):
                plane[:, block:block + n].copy_(g[:, j:j + n])


def runs(slots, positions) -> list[tuple[int, int, int]]:
    """(first slot, first position, length) of each run where both go up by one together:

        slots [5, 6, 7, 2, 3]  positions [0, 1, 2, 3, 4]  ->  [(5, 0, 3), (2, 3, 2)]
    """
    out: list[list[int]] = []
    for slot, pos in zip(slots, positions):
        if out and slot == out[-1][0] + out[-1][2] and pos == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([slot, pos, 1])
    return [(a, b, c) for a, b, c in out]


class RowPool:
    """Rung 2's memory: `num_rows` rows of `max_len` positions; a request owns one row while it runs."""

    def __init__(self, num_layers: int, num_rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_rows, max_len, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.num_rows, self.max_len = num_rows, max_len
        self.free_rows = list(range(num_rows))

    @property
    def bytes_reserved(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def allocate_row(self) -> int:
        if not self.free_rows:
            raise RuntimeError(f"all {self.num_rows} cache rows are in use; free one first")
        return self.free_rows.pop(0)

    def free_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"cache row {row} does not exist (rows 0..{self.num_rows - 1})")
        if row in self.free_rows:
            raise RuntimeError(f"cache row {row} freed twice")
        self.free_rows.append(row)

    def reset(self) -> None:
        """Every row free again (after a fault, the engine recomputes the requests that held one)."""
        self.free_rows = list(range(self.num_rows))

    def close(self) -> None:
        """Give the memory back (the engine is closed): the rows' tensors go."""
        self.k_cache = self.v_cache = None

    def move_row(self, src: int, dst: int) -> None:
        """Copy a whole row (every layer, every position) to another: what a request changing rows costs."""
        self.k_cache[:, dst] = self.k_cache[:, src]
        self.v_cache[:, dst] = self.v_cache[:, src]
