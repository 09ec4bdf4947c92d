"""minikv: a small, real LLM inference engine, built rung by rung to teach the KV cache."""
import sys as _sys
from importlib.util import spec_from_file_location as _spec_from_file_location
from pathlib import Path as _Path


class _CheckoutKernels:
    """Finds `minikv.kernels` in the repository's top-level kernels/ folder.

    An install maps that folder to minikv.kernels (pyproject.toml, package-dir); a checkout on
    PYTHONPATH has no such map, so this finder supplies it there. It goes first on sys.meta_path:
    an editable install of another checkout would otherwise hand this checkout's minikv that
    checkout's kernels."""

    folder = _Path(__file__).resolve().parent.parent / "kernels"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "minikv.kernels":
            return None
        return _spec_from_file_location(name, cls.folder / "__init__.py", submodule_search_locations=[str(cls.folder)])


if not (_Path(__file__).parent / "kernels").is_dir() and (_CheckoutKernels.folder / "__init__.py").is_file():
    if not any(getattr(f, "__name__", "") == "_CheckoutKernels" for f in _sys.meta_path):  # once, even on a reload
        _sys.meta_path.insert(0, _CheckoutKernels)

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
