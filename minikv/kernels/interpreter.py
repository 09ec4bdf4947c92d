"""Triton's interpreter on a machine without CUDA: switched on before any kernel is defined.

Without a CUDA device the kernels run in Triton's interpreter (numpy on the CPU): importing this
module sets TRITON_INTERPRET=1, unless the environment already says otherwise. The package imports
it first, so every kernel module is defined after the switch. The interpreter is exact for float32
and float16; its bfloat16 arithmetic is not, so use float32 or float16 on the CPU.
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


def interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter instead of compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
