"""Rung 7: the paged backend with its hot loops in Triton. Same pool, same block tables, same
metadata as `PagedBackend` (rung 4); only `forward` changes:

    store_kvcache            k, v -> pool slots                 (replaces an indexed copy)
    paged_decode_attention   decode-only steps: K/V read in place through the block table,
                             split-K over long contexts         (replaces gather + masked SDPA)
    paged_prefill_attention  any step with prefill rows (whole prompts, chunks, cached prefixes,
                             decode rows mixed in)
    paged_decode_attention   also a step of few new tokens per sequence (at most query_rows_max: a
      one row per token      prefix hit's suffix, a chunk's tail), each token a row over keys [0, pos]
    paged_query_rows_attention  those steps of at most 2 sequences over contexts of 4,096 keys or more
                             (a long prefix hit, a long prompt's last chunk): a sequence's rows share
                             each K/V tile they read (query_rows_impl "auto", `query_rows_kernel`)

Nothing is gathered into a padded [B, max_seq_len] copy: every K/V byte is read once, from the
pool. On a CPU the kernels run in Triton's interpreter (slow, for learning and tests); there the
pool must be float32 or float16, since the interpreter's bfloat16 arithmetic is wrong.

Measured on an H100 (benchmarks/decode_attention_gpu.json): decode on par with SDPA on never-paged
K/V at 32 x 4096 and 8 x 16384 (within 2%), 11% slower at 64 x 1024 (the split merge), 4% slower at
32 x 32768 (94% of the copy bandwidth); 4-7x faster than gather + SDPA and 25-40x faster than rung 4's masked
reference. Prefill 2-3x faster than rung 4's reference (1.5x slower than flash attention on
contiguous K/V), so prefill steps use the kernel by default.

CUDA graphs: a captured decode step keeps its split count (cut from the metadata's max_seq_len and
the batch at capture). The engine's graphs (minikv/engine/cuda_graph.py) capture with max_seq_len set
to max_model_len and no host lengths; ranges cut from that bound would leave most splits of a short
context empty and one split holding all of it, so there each program cuts its own sequence's length
into the split count instead (`split_per_seq`, read on the device). `decode_num_splits` fixes the
count where that is wanted; `decode_split_per_seq` forces either way of cutting.

A quantized pool (int8/fp8 with scales, minikv/cache/blocks/quant.py): the store kernel quantizes, the
attention kernels dequantize each tile as they read it. A learner's quantizer (the kv_quantizer seam)
is torch code, so with one the step's K/V are stored by the pool's torch `store` instead.

`decode_inner_loop` is the seam of exercise 08a: a @triton.jit function with the signature of the
decode kernel's online-softmax step, passed down as `paged_decode_attention(..., inner_loop=...)`.
"""
from __future__ import annotations

import torch

from minikv.attention.common import attend
from minikv.attention.metadata import PagedMetadata
from minikv.attention.paged import PagedBackend
from minikv.cache.blocks.pool import KVPool
from minikv.cache.blocks.quant import quantize_block
from minikv.kernels import paged_decode_attention, paged_prefill_attention, store_kvcache
from minikv.kernels.query_rows_attention import paged_query_rows_attention


class TritonPagedBackend(PagedBackend):
    attention = "triton"
    # prefill steps: "triton" (the paged prefill kernel) or "torch" (rung 4's gather + masked SDPA)
    prefill_impl = "triton"
    # decode split count; None = chosen per step from the batch and the longest context
    decode_num_splits: int | None = None
    # split ranges cut per sequence on the device (True) or from max_seq_len on the host (False);
    # None = per sequence exactly when the host does not know the lengths (a CUDA graph's buffers)
    decode_split_per_seq: bool | None = None
    # steps whose longest query run is at most this many tokens are query-row steps (`_query_rows`)
    query_rows_max: int = 32
    # those steps: "decode" (the decode kernel, one row per token), "grouped" (paged_query_rows_attention, a
    # sequence's rows share K/V reads; never with a sliding window or a learner's inner loop) or "auto": grouped
    # for a step of few sequences over a long context (`query_rows_kernel`), decode otherwise
    query_rows_impl: str = "auto"
    # "grouped" split count; None = chosen per step (query_rows_num_splits in minikv/kernels/query_rows_attention.py)
    query_rows_num_splits: int | None = None
    # "auto" takes the grouped kernel for at most this many sequences, all contexts at least this long.
    # Measured on an H100 (benchmarks/RESULTS.md, 2026-11-27): a hit's whole step of 32 rows over 8k keys
    # 1.13x, 4k 1.03x, 2k 0.97x; 32 to 255 one-row sequences 2.8-3.9x slower than the decode kernel (each
    # program walks several groups in turn)
    grouped_max_seqs: int = 2
    grouped_min_context: int = 4096
    # set while a CUDA graph is captured (its host lengths are only bounds): the kernel that graph records
    query_rows_capture: str | None = None

    def __init__(self, pool: KVPool, sliding_window: int | None = None, sink_tokens: int = 0, decode_inner_loop=None):
        if pool.device.type != "cuda" and pool.dtype == torch.bfloat16:
            raise ValueError("the Triton kernels run in the interpreter on a CPU, whose bfloat16 arithmetic is "
                             "wrong; use dtype float32 or float16 there (bfloat16 is fine on a GPU)")
        super().__init__(pool, sliding_window, sink_tokens)
        self.decode_inner_loop = decode_inner_loop  # None: the kernel's own online-softmax step

    def query_rows_kernel(self, meta: PagedMetadata | None = None, num_seqs: int | None = None,
                          min_context: int | None = None) -> str:
        """"grouped" or "decode": the kernel of a query-row step, from query_rows_impl; "auto" decides from the
        step's sequences and their shortest context, given (StepGraphs, which picks a graph) or read from the
        metadata's host lengths. Without those (a graph being captured) it is the capture's choice."""
        if self.sliding_window or self.decode_inner_loop is not None:
            return "decode"
        if self.query_rows_impl not in ("auto", "grouped", "decode"):
            raise ValueError(f"query_rows_impl is {self.query_rows_impl!r}; use 'auto' (the grouped kernel for few "
                             "sequences over long contexts), 'grouped' or 'decode'")
        if self.query_rows_impl != "auto":
            return self.query_rows_impl
        if num_seqs is None:
            if meta is None or meta.seq_lens_list is None:  # a graph's bounds: what its capture records
                return self.query_rows_capture or "decode"
            num_seqs, min_context = meta.num_seqs, min(meta.seq_lens_list)
        return "grouped" if num_seqs <= self.grouped_max_seqs and min_context >= self.grouped_min_context else "decode"

    def _query_rows(self, q, k_cache, v_cache, meta: PagedMetadata, scale: float, k_scale, v_scale, k_zero, v_zero):
        """A step of few new tokens per sequence (a prefix hit's suffix, a chunk's tail, decodes beside a short
        prompt) through the split-K decode kernel, each new token its own row: the token at position p reads
        its sequence's block table over keys [0, p] (causal by construction). The prefill kernel gives such a
        step one program per (sequence, head) walking the whole context alone; here the context is cut into
        splits across the GPU, and a row's K/V reads hit the cache its neighbours' rows just filled.

        When `query_rows_kernel` says "grouped" (query_rows_impl "auto": a long hit's step) the rows of one
        sequence go further and share their reads: paged_query_rows_attention gives one program up to 8 of
        them over one KV head, each K/V tile loaded once for all of them (a hit's 32 rows read its context
        4 times, not 32)."""
        if "query_rows_kernel" not in meta.step_memo:  # once per step, for every layer
            meta.step_memo["query_rows_kernel"] = self.query_rows_kernel(meta)
        if meta.step_memo["query_rows_kernel"] == "grouped":
            return paged_query_rows_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                              meta.seq_lens, scale, meta.max_seq_len,
                                              num_splits=self.query_rows_num_splits, k_scale=k_scale,
                                              v_scale=v_scale, k_zero=k_zero, v_zero=v_zero)
        if "query_rows" not in meta.step_memo:  # once per step, for every layer
            meta.step_memo["query_rows"] = (meta.block_tables.index_select(0, meta.token_seq), meta.token_pos + 1)
        tables, lens = meta.step_memo["query_rows"]
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=self.decode_num_splits,
                                      sliding_window=self.sliding_window, sink_tokens=self.sink_tokens,
                                      max_seq_len=meta.max_seq_len, inner_loop=self.decode_inner_loop,
                                      k_scale=k_scale, v_scale=v_scale, k_zero=k_zero, v_zero=v_zero,
                                      split_per_seq=True)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.pool.quantizer is not quantize_block:  # the kv_quantizer seam: torch code, slot -1 skipped
            keep = slot_mapping >= 0
            self.pool.store(layer, k[keep], v[keep], slot_mapping[keep])
            return
        k_scale, v_scale = self.pool.layer_scales(layer)  # None unless the pool is quantized
        k_zero, v_zero = self.pool.layer_zeros(layer)  # None unless it is int8
        store_kvcache(k, v, *self.pool.layer(layer), slot_mapping, k_scale, v_scale, k_zero, v_zero)  # slot -1: skipped

    def forward(self, layer, q, k, v, meta: PagedMetadata, scale: float) -> torch.Tensor:
        self.store(layer, k, v, meta.slot_mapping)
        k_cache, v_cache = self.pool.layer(layer)
        k_scale, v_scale = self.pool.layer_scales(layer)  # None unless the pool is quantized
        k_zero, v_zero = self.pool.layer_zeros(layer)  # None unless it is int8
        if meta.is_decode_only:  # one token per sequence: q [B, num_heads, head_dim]
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          num_splits=self.decode_num_splits, sliding_window=self.sliding_window,
                                          sink_tokens=self.sink_tokens, max_seq_len=meta.max_seq_len,
                                          inner_loop=self.decode_inner_loop, k_scale=k_scale, v_scale=v_scale,
                                          k_zero=k_zero, v_zero=v_zero,
                                          split_per_seq=(meta.seq_lens_list is None if self.decode_split_per_seq
                                                         is None else self.decode_split_per_seq))
        if meta.max_query_len <= self.query_rows_max and self.prefill_impl == "triton":
            return self._query_rows(q, k_cache, v_cache, meta, scale, k_scale, v_scale, k_zero, v_zero)
        if self.prefill_impl == "torch":
            keys, values = self.gather(layer, meta)
            return attend(q, keys, values, meta, scale, self.sliding_window, self.sink_tokens)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       scale, sliding_window=self.sliding_window,
                                       sink_tokens=self.sink_tokens, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero,
                                       v_zero=v_zero)
