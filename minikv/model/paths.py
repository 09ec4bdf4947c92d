"""Directories the model loaders write into (the model cache, GGUF conversions)."""
from __future__ import annotations

from pathlib import Path


def writable_dir(path: Path) -> Path:
    """`path`, created if missing; a ValueError naming it and the fix if it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the model cache directory {path} ({e.strerror or e}); point MINIKV_CACHE "
                         "at a directory you can write") from None
    return path
