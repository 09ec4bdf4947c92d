"""Triton kernels of minikv, imported as `minikv.kernels` (never as a top-level `kernels`).

    store_kvcache            write this step's K/V into their pool slots (the slot mapping)
    paged_decode_attention   one query token per sequence, K/V read through the block table, split-K
    paged_prefill_attention  causal varlen attention of new tokens over their paged context

Without a CUDA device the kernels run in Triton's interpreter (numpy on the CPU): we set
TRITON_INTERPRET=1 here, before any kernel is defined, unless the environment already says
otherwise. The interpreter is exact for float32 and float16; its bfloat16 arithmetic is not, so
use float32 or float16 on the CPU.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    _imported_before = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.language as _tl
    from triton.runtime.jit import JITFunction as _JITFunction

    if _imported_before and isinstance(_tl.max, _JITFunction):
        raise ImportError(
            "triton was imported before minikv.kernels on a machine without CUDA, so its own helpers "
            "(tl.max, tl.sum, ...) were built for a GPU and the interpreter cannot run them. Restart Python "
            "and import minikv.kernels first, or set TRITON_INTERPRET=1 before importing triton.")

from minikv.kernels.decode_attention import default_num_splits, paged_decode_attention  # noqa: E402
from minikv.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from minikv.kernels.store_kvcache import store_kvcache  # noqa: E402


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter instead of compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


__all__ = ["default_num_splits", "interpreted", "paged_decode_attention", "paged_prefill_attention", "store_kvcache"]
