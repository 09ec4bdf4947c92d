"""Reading a quantized pool inside the attention kernels: one tile of K or V, dequantized in registers.

    pool       [num_blocks, block_size, num_kv_heads, head_dim]  int8 / fp8 (or the model's dtype)
    its scales [num_blocks, block_size, num_kv_heads]            float32, one per token and KV head
    tile       [BLOCK_N, HEAD_PAD] = pool row * its scale        (minikv/cache/quant.py's dequantize_block)

Only 8-bit values and one scale per row cross the memory bus; the multiply happens where the
values land, so a decode step reads about half the bytes of a 16-bit pool.
"""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(cache_ptr, scale_ptr, row, scale_row, d, mask, valid, QUANT: tl.constexpr):
    """cache[row + d] for the masked rows; times scale[scale_row] (float32) when QUANT.

    row, scale_row, valid [BLOCK_N]  d [HEAD_PAD]  mask [BLOCK_N, HEAD_PAD]"""
    x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        s = tl.load(scale_ptr + scale_row, mask=valid, other=0.0)
        x = x.to(tl.float32) * s[:, None]
    return x


def quant_args(k_scale, v_scale, k_cache):
    """(k_scale, v_scale, block stride, slot stride, head stride, QUANT) for a kernel launch; the
    caches stand in for the scale pointers of a pool that is not quantized (never read then)."""
    if k_scale is None:
        return k_cache, k_cache, 0, 0, 0, False
    if v_scale is None or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride():
        raise ValueError("a quantized pool needs K and V scales of one shape and layout")
    if tuple(k_scale.shape) != tuple(k_cache.shape[:3]):
        raise ValueError(f"scales {tuple(k_scale.shape)} must be [num_blocks, block_size, num_kv_heads] "
                         f"= {tuple(k_cache.shape[:3])}")
    return (k_scale, v_scale, *k_scale.stride(), True)
