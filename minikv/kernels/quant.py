"""Reading a quantized pool inside the attention kernels: one tile of K or V, dequantized in registers.

    pool       [num_blocks, block_size, num_kv_heads, head_dim]  int8 / fp8 (or the model's dtype)
    its scales [num_blocks, block_size, num_kv_heads]            float32, one per token and KV head
    its zeros  [num_blocks, block_size, num_kv_heads]            float32, int8 only (the same indexing)
    tile       [BLOCK_N, HEAD_PAD] = pool row * its scale (+ its zero)
               (minikv/cache/blocks/quant.py's dequantize_block)

Only 8-bit values and one scale (and zero point) per row cross the memory bus; the multiply-add
happens where the values land, so a decode step reads about half the bytes of a 16-bit pool.
"""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(cache_ptr, scale_ptr, zero_ptr, row, scale_row, d, mask, valid, QUANT: tl.constexpr,
                 HAS_ZERO: tl.constexpr):
    """cache[row + d] for the masked rows; times scale[scale_row] (float32) when QUANT, plus
    zero[scale_row] when HAS_ZERO (0 outside the mask, so padded channels stay 0).

    row, scale_row, valid [BLOCK_N]  d [HEAD_PAD]  mask [BLOCK_N, HEAD_PAD]"""
    x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
    if QUANT:
        s = tl.load(scale_ptr + scale_row, mask=valid, other=0.0)
        x = x.to(tl.float32) * s[:, None]
        if HAS_ZERO:
            z = tl.load(zero_ptr + scale_row, mask=valid, other=0.0)
            x = tl.where(mask, x + z[:, None], 0.0)
    return x


@triton.jit
def load_kv_tiles(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, block, pos, kv_head,
                  d, valid, d_ok, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
                  BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, HAS_ZERO: tl.constexpr):
    """The K and V tiles of positions `pos` of one KV head, `block` [BLOCK_N] holding each position's
    physical block: paged addressing (block * stride + offset in block) then `load_kv_tile` for each.

    pos, block, valid [BLOCK_N]  d, d_ok [HEAD_PAD]  ->  k, v [BLOCK_N, HEAD_PAD]"""
    row = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    srow = block * stride_sb + (pos % BLOCK_SIZE) * stride_ss + kv_head * stride_sh
    kv_mask = valid[:, None] & d_ok[None, :]
    k = load_kv_tile(k_cache_ptr, k_scale_ptr, k_zero_ptr, row, srow, d, kv_mask, valid, QUANT, HAS_ZERO)
    v = load_kv_tile(v_cache_ptr, v_scale_ptr, v_zero_ptr, row, srow, d, kv_mask, valid, QUANT, HAS_ZERO)
    return k, v


def quant_args(k_scale, v_scale, k_cache, k_zero=None, v_zero=None):
    """(k_scale, v_scale, k_zero, v_zero, block stride, slot stride, head stride, QUANT, HAS_ZERO) for a
    kernel launch; the caches stand in for the pointers a pool does not have (never read then)."""
    if k_scale is None:
        if k_zero is not None or v_zero is not None:
            raise ValueError("zero points come with scales: pass k_scale and v_scale too")
        return k_cache, k_cache, k_cache, k_cache, 0, 0, 0, False, False
    if v_scale is None or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride():
        raise ValueError("a quantized pool needs K and V scales of one shape and layout")
    if tuple(k_scale.shape) != tuple(k_cache.shape[:3]):
        raise ValueError(f"scales {tuple(k_scale.shape)} must be [num_blocks, block_size, num_kv_heads] "
                         f"= {tuple(k_cache.shape[:3])}")
    if (k_zero is None) != (v_zero is None) or (k_zero is not None and any(
            z.shape != k_scale.shape or z.stride() != k_scale.stride() for z in (k_zero, v_zero))):
        raise ValueError("zero points (int8 pools) need K and V both, shaped and laid out like the scales")
    has_zero = k_zero is not None
    return (k_scale, v_scale, k_zero if has_zero else k_scale, v_zero if has_zero else v_scale,
            *k_scale.stride(), True, has_zero)
