"""minikv: a small, real LLM inference engine, built rung by rung to teach the KV cache."""
import sys as _sys

# Without CUDA the kernels run in Triton's interpreter, which must be switched on before triton is
# imported; transformers may import it before minikv.kernels is, so the switch is set here already.
# (If triton came first, minikv/kernels/interpreter.py says so, with the fix, when the kernels load.)
if "triton" not in _sys.modules:
    import torch as _torch

    if not _torch.cuda.is_available():
        import os as _os

        _os.environ.setdefault("TRITON_INTERPRET", "1")

from minikv.engine import LLM, RequestOutput, SamplingParams, StreamEvent  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
__version__ = "0.1.0"
