"""Model shapes and what their KV cache weighs: the formula, and the shapes of real models.

Every layer keeps a key and a value vector per KV head for every token it has seen:

    kv bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes per number x tokens x batch

Grouped-query attention (GQA) shrinks `kv_heads`: several query heads share one K/V head. Multi-head
attention (MHA) is the special case kv_heads == heads. Plain arithmetic, no torch: the calculator and
plot of minikv/viz/memory.py and the system-design calculators of minikv/interview/design.py read it.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder that decide its KV-cache size (and its weight size, for scale)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float  # weights, for comparing the cache with the model itself
    max_context: int

    @property
    def attention(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return f"GQA, {self.num_heads // self.num_kv_heads} query heads per kv head"


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("SmolLM2-135M", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   num_params=134.5e6, max_context=8192),
        ModelShape("Llama-2-7B", num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                   num_params=6.74e9, max_context=4096),
        ModelShape("Llama-3-70B", num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                   num_params=70.6e9, max_context=8192),
    )
}

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16 / fp16": 2, "int8 / fp8": 1}


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                   batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for `batch_size` sequences of `num_tokens` tokens each."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * num_tokens * batch_size


def model_kv_bytes(model: ModelShape | str, num_tokens: int, batch_size: int = 1, dtype_bytes: int = 2,
                   mha: bool = False) -> int:
    """`kv_cache_bytes` of a known model; `mha=True` prices the same model with kv_heads = heads."""
    m = MODELS[model] if isinstance(model, str) else model
    kv_heads = m.num_heads if mha else m.num_kv_heads
    return kv_cache_bytes(m.num_layers, kv_heads, m.head_dim, num_tokens, batch_size, dtype_bytes)


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; binary units, three significant figures."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
