"""minikv: a small, real LLM inference engine, built rung by rung to teach the KV cache."""
import os as _os
import sys as _sys


def _cuda_may_be_here() -> bool:
    """False only where no CUDA (or ROCm) device can exist: no driver's device files and no libcuda. This
    needs no torch (whose import takes most of a second), so `minikv quiz` starts at once on a laptop."""
    if _sys.platform == "darwin":
        return False
    if any(_os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/dxg",
                                        "/dev/kfd")):
        return True
    import ctypes.util

    return ctypes.util.find_library("cuda") is not None


# Without CUDA the kernels run in Triton's interpreter, which must be switched on before triton is
# imported; transformers (or the learner's own cell) may import it before minikv.kernels is, so the
# switch is set here already. Where a device may exist, torch decides, as minikv/kernels/interpreter.py
# does. (If triton came first, minikv/kernels/interpreter.py says so, with the fix, when the kernels load.)
if "triton" not in _sys.modules:
    if not _cuda_may_be_here():
        _os.environ.setdefault("TRITON_INTERPRET", "1")
    else:
        import torch as _torch

        if not _torch.cuda.is_available():
            _os.environ.setdefault("TRITON_INTERPRET", "1")

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """The engine's names load on first use (`from minikv import LLM`): importing minikv alone needs no torch."""
    if name in __all__:
        from minikv import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'minikv' has no attribute {name!r}")
