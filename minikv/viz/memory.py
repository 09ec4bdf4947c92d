"""How much memory the KV cache takes: a calculator and a plot over the model shapes of
minikv/model/shapes.py (the formula and the catalogue). The widget and the plot only call its plain
functions.
"""
from __future__ import annotations

from minikv.model.shapes import DTYPE_BYTES, GIB, MODELS, ModelShape, format_bytes, model_kv_bytes
from minikv.viz.view import view


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
