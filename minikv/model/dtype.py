"""The dtypes the model runs in, and the names a user may give them."""
from __future__ import annotations

from typing import Any

import torch

# float32 on a CPU (exact, what the ladder's equality proofs use), bfloat16 on a GPU (half the memory,
# tensor cores), float16 where bfloat16 is slow or wrong (Triton's CPU interpreter)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def parse_dtype(dtype: Any, device: torch.device | str | None = None) -> torch.dtype | None:
    """A torch.dtype or its name ("bfloat16", "bf16", "torch.float16") -> the torch.dtype.

    None or "auto" -> the device's default: bfloat16 on a GPU, float32 otherwise (None if no device given).
    """
    if dtype is None or dtype == "auto":
        if device is None:
            return None
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        name = ALIASES.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (a torch.dtype, its name, or "
                     f"{', '.join(ALIASES)}), or None / 'auto' for the device's default; got {dtype!r}")
