"""When the cache does not fit: the KV memory of real models at long contexts and many users, and
what each strategy buys (notebook 09).

What one token costs, per layer, by attention type:

    MHA   K and V for every query head          2 x heads x head_dim values
    GQA   K and V for each group of query heads  2 x kv_heads x head_dim        (kv_heads < heads)
    MQA   one K/V head for all query heads       2 x 1 x head_dim
    MLA   one latent vector c (K and V are rebuilt from it by up-projections folded into the query
          and output weights) plus one small RoPE key shared by all heads:
                                                 kv_lora_rank + qk_rope_head_dim

times the layers and the bytes per value (2 in bf16; 1 in 8 bits, plus what each stored vector
needs to be read back: a float32 scale and a float32 zero point per token and KV head, as minikv's
int8 pool stores them; its fp8 pool keeps the scale only, 4 bytes less). A sliding window of W with S
sinks holds at most S + W tokens per sequence, whatever its length.

The shapes below are copied by hand from each model's published config.json (Hugging Face hub, as
released); they are constants, nothing is downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass

from minikv.viz.view import view

GIB = 1024**3
GPU_GIB = 80  # one H100 (80 GB card; about 79 GiB usable), for scale
CONTEXTS = (8192, 16384, 32768, 65536, 131072)
SCALE_BYTES = 8  # a float32 scale and zero point per (token, KV head) in an int8 pool (fp8: the scale, 4)


@dataclass(frozen=True)
class KVShape:
    """The numbers of a decoder that decide its KV cache."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim values per token and layer (0: not MLA)
    sliding_window: int | None = None  # the model's own window, from its config
    note: str = ""

    @property
    def attention(self) -> str:
        if self.latent_dim:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def values_per_token(self) -> int:
        """Numbers stored per token, all layers."""
        if self.latent_dim:
            return self.num_layers * self.latent_dim
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def bytes_per_token(self, dtype: str = "bf16") -> float:
        """bf16: 2 bytes a value; 8 bits: 1 byte a value plus a float32 scale and zero point per vector it
        stores (the int8 pool's format; fp8 needs 4 bytes less per vector)."""
        if dtype == "bf16":
            return 2 * self.values_per_token()
        vectors = self.num_layers if self.latent_dim else 2 * self.num_layers * self.num_kv_heads
        return self.values_per_token() + SCALE_BYTES * vectors


MODELS: dict[str, KVShape] = {m.name: m for m in (
    KVShape("Llama-3-8B", 32, 32, 8, 128, note="Llama 3.1 keeps this shape for 128k contexts"),
    KVShape("Llama-3-8B as MHA", 32, 32, 32, 128, note="the same shape with one K/V head per query head"),
    KVShape("Llama-3-8B as MQA", 32, 32, 1, 128, note="the same shape with one K/V head for all"),
    KVShape("Llama-3-70B", 80, 64, 8, 128),
    KVShape("Mistral-7B-v0.1", 32, 32, 8, 128, sliding_window=4096,
            note="v0.1's config has sliding_window 4096; later versions dropped it"),
    KVShape("Qwen2.5-7B", 28, 28, 4, 128),
    KVShape("Qwen2.5-72B", 80, 64, 8, 128),
    KVShape("DeepSeek-V3", 61, 128, 128, 192, latent_dim=512 + 64,
            note="MLA: kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer"),
    KVShape("SmolLM2-135M", 30, 9, 3, 64, note="the course's model"),
)}


def mha_equivalent_bytes(m: KVShape) -> int:
    """What DeepSeek-V3 would store per token (bf16) with plain MHA of its head sizes: K of
    qk_nope 128 + rope 64 = 192 dims and V of 128 dims per head, 128 heads, 61 layers."""
    return 2 * m.num_layers * m.num_heads * (192 + 128)


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def held_tokens(context: int, window: int | None, sinks: int = 4) -> int:
    """Tokens a sequence of `context` tokens keeps in the cache: all, or its sinks and its window."""
    return context if window is None else min(context, sinks + window)


def cache_bytes(m: KVShape, context: int, users: int, dtype: str = "bf16", window: int | None = None) -> float:
    return m.bytes_per_token(dtype) * held_tokens(context, window) * users


def budget_lines(model: str, context: int, users: int, dtype: str = "bf16", window: int | None = None) -> list[str]:
    """The calculator's answer in words (the widget shows it; the notebook's fallback prints it)."""
    m = MODELS[model]
    per_token = m.bytes_per_token(dtype)
    one = cache_bytes(m, context, 1, dtype, window)
    total = cache_bytes(m, context, users, dtype, window)
    if m.latent_dim:
        shape = f"{m.num_layers} layers x {m.latent_dim} latent"
    else:
        shape = f"2 x {m.num_layers} layers x {m.num_kv_heads} kv heads x {m.head_dim}"
    unit = "2 B" if dtype == "bf16" else "1 B + scale and zero point"
    lines = [f"{m.name} ({m.attention}, {m.num_heads} query heads{'; ' + m.note if m.note else ''})",
             f"per token: {shape} values x {unit} = {format_bytes(per_token)}",
             f"one user, {context:,} tokens{'' if window is None else f' (window {window:,} + 4 sinks)'}: "
             f"{format_bytes(one)}",
             f"{users} users: {format_bytes(total)} = {total / (GPU_GIB * GIB):.1f} x an {GPU_GIB} GiB GPU, "
             "for the cache alone"]
    if m.latent_dim:
        lines.append(f"the same model with MHA would store {format_bytes(mha_equivalent_bytes(m))} per token in bf16 "
                     f"({mha_equivalent_bytes(m) / per_token:.0f}x this cache)")
    return lines


def budget_calculator(model: str = "Llama-3-8B", context: int = 32768, users: int = 100):
    """An ipywidgets calculator: model, context, users, bf16 or 8-bit, a sliding window or not."""
    import ipywidgets as w

    pick = w.Dropdown(options=list(MODELS), value=model, description="model")
    ctx = w.SelectionSlider(options=[(f"{c // 1024}k", c) for c in CONTEXTS], value=context, description="context")
    n = w.IntSlider(value=users, min=1, max=256, description="users", continuous_update=False)
    dtype = w.ToggleButtons(options=[("bf16", "bf16"), ("int8 + scales, zeros", "8bit")], value="bf16")
    # "no window" is 0, not None: a None value leaves the dropdown with no option selected
    window = w.Dropdown(options=[("no window", 0), ("window 4096 + 4 sinks", 4096), ("window 8192 + 4 sinks", 8192)],
                        value=0, description="window")
    out = w.HTML()

    def lines() -> list[str]:
        return budget_lines(pick.value, ctx.value, n.value, dtype.value, window.value or None)

    def update(_=None):
        out.value = "<pre>" + "\n".join(lines()) + "</pre>"

    for widget in (pick, ctx, n, dtype, window):
        widget.observe(update, names="value")
    update()
    return view([w.HBox([pick, window]), ctx, n, dtype, out],
                "a KV budget calculator (model, context, users, 16 or 8 bits, sliding window)",
                details=lambda: "\n".join(lines()))


def plot_budget(models: list[str], contexts: tuple[int, ...] = (8192, 32768, 131072), users: int = 100, ax=None):
    """GiB of KV cache for `users` users, one group of bars per model, one bar per context (log scale),
    with one GPU and one 8-GPU node drawn for scale."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(contexts)
    for j, c in enumerate(contexts):
        xs = [i + (j - (len(contexts) - 1) / 2) * width for i in range(len(models))]
        ax.bar(xs, [cache_bytes(MODELS[m], c, users) / GIB for m in models], width, label=f"{c // 1024}k tokens")
    ax.axhline(GPU_GIB, color="red", ls=":", label=f"one {GPU_GIB} GiB GPU")
    ax.axhline(8 * GPU_GIB, color="red", ls="--", label="8 GPUs")
    ax.set_yscale("log")
    names = [m.replace(" as ", "\nas ") for m in models]  # "Llama-3-8B as MHA" on two lines, off its neighbours
    ax.set_xticks(range(len(models)), [f"{name}\n({MODELS[m].attention})" for name, m in zip(names, models)],
                  fontsize=8)
    ax.set_ylabel(f"KV cache, {users} users (GiB)")
    ax.set_title(f"bf16 KV cache of {users} users, each at the full context")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside the bars, never on them
    ax.grid(alpha=0.3, axis="y")
    ax.figure.tight_layout()
    return ax.figure


# ---- one block of a quantized pool -------------------------------------------------------------------
def block_bytes_lines(block, dtype_name: str) -> list[str]:
    """What one block of one layer costs and loses in `dtype_name` ("int8" or "fp8"): payload, scales,
    and the error of each element. block [block_size, num_kv_heads, head_dim] in full precision."""
    import torch

    from minikv.cache.blocks.quant import dequantize_block, quantize_block

    dtype = torch.int8 if dtype_name == "int8" else torch.float8_e4m3fn
    q, scale, zero = quantize_block(block, dtype)
    err = (dequantize_block(q, scale, zero) - block.float()).abs()
    T, H, D = block.shape
    payload, bf16 = q.numel() * q.element_size(), block.numel() * 2
    scales = scale.numel() * 4 * (1 if zero is None else 2)
    what = "scales (one float32 per token and head)" if zero is None else \
        "scales and zero points (two float32 per token and head)"
    return [f"one block of one layer: {T} tokens x {H} kv heads x {D} values",
            f"  bf16: {bf16:,} B    {dtype_name}: {payload:,} B payload + {scales:,} B {what} "
            f"= {payload + scales:,} B ({bf16 / (payload + scales):.2f}x less)",
            f"  error per element: max {err.max().item():.4f}, mean {err.mean().item():.5f}; "
            f"relative to the block's values: {(err.norm() / block.float().norm()).item():.4f}"]


def plot_block_error(block, dtype_name: str, head: int = 0, ax=None):
    """|dequantized - original| of each element of one kv head of one block: tokens x head_dim."""
    import matplotlib.pyplot as plt
    import torch

    from minikv.cache.blocks.quant import dequantize_block, quantize_block

    dtype = torch.int8 if dtype_name == "int8" else torch.float8_e4m3fn
    q, scale, zero = quantize_block(block, dtype)
    err = (dequantize_block(q, scale, zero) - block.float()).abs()[:, head]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.4))
    im = ax.imshow(err, aspect="auto", cmap="viridis")
    ax.set_xlabel("channel (head_dim)")
    ax.set_ylabel("token in block")
    ax.set_title(f"{dtype_name}: |error| of each element, kv head {head} ("
                 + ("per row: [min, max] onto [-127, 127]" if dtype_name == "int8" else "scale per row: absmax / 448")
                 + ")", fontsize=9)
    ax.figure.colorbar(im, ax=ax)
    return ax.figure


def quant_block_widget(blocks: dict):
    """Pick a block (`blocks`: name -> [block_size, kv_heads, head_dim] tensor), int8 or fp8, a kv head:
    its bytes (payload and scales) and the error of each element."""
    import ipywidgets as w

    from minikv.viz.pool import figure_png

    first = next(iter(blocks.values()))
    pick = w.Dropdown(options=list(blocks), description="block")
    dtype = w.ToggleButtons(options=["int8", "fp8"], value="int8")
    head = w.IntSlider(value=0, min=0, max=first.shape[1] - 1, description="kv head", continuous_update=False)
    text, image = w.HTML(), w.Image(format="png")

    def update(_=None):
        b = blocks[pick.value]
        text.value = "<pre>" + "\n".join(block_bytes_lines(b, dtype.value)) + "</pre>"
        image.value = figure_png(plot_block_error(b, dtype.value, head.value))

    for widget in (pick, dtype, head):
        widget.observe(update, names="value")
    update()
    return view([w.HBox([pick, dtype]), head, text, image], "one block of a quantized pool: bytes and error",
                details=lambda: "\n".join(block_bytes_lines(blocks[pick.value], dtype.value)),
                picture=lambda: image.value)
