"""How much memory the KV cache takes: the formula, real model shapes, a calculator and a plot.

Every layer keeps a key and a value vector per KV head for every token it has seen:

    kv bytes = 2 (K and V) x layers x kv_heads x head_dim x bytes per number x tokens x batch

Grouped-query attention (GQA) shrinks `kv_heads`: several query heads share one K/V head. Multi-head
attention (MHA) is the special case kv_heads == heads. The functions here are plain and pure; the
widget and the plot only call them.
"""
from __future__ import annotations

from dataclasses import dataclass

from minikv.viz.view import view

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


def calculator_lines(model: ModelShape | str, dtype_bytes: int, context_len: int, batch_size: int,
                     mha: bool = False, gpu_gib: float = 80) -> list[str]:
    """The calculator's answer as plain lines (the widget shows them; tests read them)."""
    m = MODELS[model] if isinstance(model, str) else model
    kv_heads = m.num_heads if mha else m.num_kv_heads
    per_token = model_kv_bytes(m, 1, 1, dtype_bytes, mha)
    total = model_kv_bytes(m, context_len, batch_size, dtype_bytes, mha)
    weights = m.num_params * dtype_bytes
    lines = [
        f"{m.name}: {m.num_layers} layers, {m.num_heads} query heads, {kv_heads} kv heads, head_dim {m.head_dim}"
        + (" (priced as MHA)" if mha and m.num_kv_heads != m.num_heads else f" ({m.attention})"),
        f"per token: 2 x {m.num_layers} x {kv_heads} x {m.head_dim} x {dtype_bytes} B = {format_bytes(per_token)}",
        f"{batch_size} x {context_len:,} tokens: {format_bytes(total)}",
        f"weights in the same dtype: {format_bytes(weights)} (cache / weights = {total / weights:.2f})",
        f"fits next to the weights on a GPU of {gpu_gib:g} GiB: {'yes' if total + weights <= gpu_gib * GIB else 'no'}",
    ]
    if m.num_kv_heads != m.num_heads:
        other = model_kv_bytes(m, context_len, batch_size, dtype_bytes, not mha)
        name = "GQA" if mha else "MHA"
        lines.append(f"the same model with {name}: {format_bytes(other)} ({max(other, total) / min(other, total):.0f}x "
                     f"{'less' if other < total else 'more'})")
    return lines


def kv_calculator(gpu_gib: float = 80):
    """An ipywidgets calculator: model, dtype, context length, batch size, MHA-vs-GQA. Returns the widget."""
    import ipywidgets as w

    model = w.Dropdown(options=list(MODELS), value="Llama-3-70B", description="model")
    dtype = w.Dropdown(options=[(f"{k} ({v} B)", v) for k, v in DTYPE_BYTES.items()], value=2, description="dtype")
    context = w.IntSlider(value=8192, min=128, max=131072, step=128, description="context", continuous_update=False)
    batch = w.IntSlider(value=1, min=1, max=256, description="batch", continuous_update=False)
    mha = w.Checkbox(value=False, description="MHA: kv_heads = heads")
    out = w.HTML()

    def update(_=None):
        lines = calculator_lines(model.value, dtype.value, context.value, batch.value, mha.value, gpu_gib)
        out.value = "<pre>" + "\n".join(lines) + "</pre>"

    for widget in (model, dtype, context, batch, mha):
        widget.observe(update, names="value")
    update()
    return view([w.HBox([model, dtype]), context, batch, mha, out],
                "a KV-cache calculator (model, dtype, context length, batch size, MHA or GQA)",
                details=lambda: "\n".join(calculator_lines(model.value, dtype.value, context.value, batch.value,
                                                           mha.value, gpu_gib)))


def plot_kv_vs_context(model: ModelShape | str = "Llama-3-70B", batch_sizes: tuple[int, ...] = (1, 8, 32, 128),
                       dtype_bytes: int = 2, max_context: int | None = None, gpu_gib: float = 80, ax=None):
    """KV-cache size against context length, one line per batch size, with the weights and one GPU
    drawn for scale. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    m = MODELS[model] if isinstance(model, str) else model
    max_context = max_context or m.max_context
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    contexts = list(range(0, max_context + 1, max(1, max_context // 64)))[1:]
    for b in batch_sizes:
        ax.plot(contexts, [model_kv_bytes(m, c, b, dtype_bytes) / GIB for c in contexts], label=f"batch {b}")
    ax.axhline(m.num_params * dtype_bytes / GIB, color="gray", ls="--", label="weights")
    ax.axhline(gpu_gib, color="red", ls=":", label=f"one {gpu_gib:g} GiB GPU")
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel("KV cache (GiB, log scale)")
    ax.set_title(f"{m.name} KV cache ({dtype_bytes}-byte numbers, {m.num_kv_heads} kv heads for {m.num_heads} q heads)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax.figure
