"""Triton kernels of minikv (`minikv.kernels`, an ordinary subpackage).

    store_kvcache            write this step's K/V into their pool slots (the slot mapping)
    paged_decode_attention   one query token per sequence, K/V read through the block table, split-K
    paged_prefill_attention  causal varlen attention of new tokens over their paged context
    paged_query_rows_attention  (query_rows_attention.py) few new tokens of a sequence over a long paged
                             context, split-K, the rows sharing each K/V tile (a long prefix hit's step)
    fused_add_rms_norm       residual add + RMSNorm of a decoder layer, one read and one write per row
    rotary_qkv               the merged q/k/v projection split, with the rotary embedding on q and k
    silu_and_mul             SwiGLU's SiLU(gate) * up over the merged gate/up projection
    sample_rows              temperature / top-p draws of whole rows, the nucleus found by pivoting

Without a CUDA device the kernels run in Triton's interpreter (numpy on the CPU; see interpreter.py,
imported first): use float32 or float16 there, its bfloat16 arithmetic is not exact.
"""
# the interpreter first: on a CPU it switches Triton to its interpreter before any kernel is defined
from minikv.kernels.interpreter import interpreted  # noqa: I001
from minikv.kernels.decode_attention import default_num_splits, paged_decode_attention
from minikv.kernels.fused_activation import silu_and_mul
from minikv.kernels.fused_norm import fused_add_rms_norm
from minikv.kernels.fused_rope import rotary_qkv
from minikv.kernels.prefill_attention import paged_prefill_attention
from minikv.kernels.sample import sample_rows
from minikv.kernels.store_kvcache import store_kvcache

__all__ = ["default_num_splits", "fused_add_rms_norm", "interpreted", "paged_decode_attention",
           "paged_prefill_attention", "rotary_qkv", "sample_rows", "silu_and_mul", "store_kvcache"]
