"""What each generation step computes and what it reads: the naive engine (rung 1) beside the KV cache
(rung 2), step by step, for one real generation (notebooks 01 and 02).

A prompt of P tokens and N new tokens take N steps. Step t samples new token t from a sequence of
n = P + t positions:

    naive (rung 1)    every step:  [0, n)      K/V computed again, nothing kept afterwards
    cached (rung 2)   step 0:      [0, P)      K/V computed (the prefill), stored
                      step t >= 1: [0, n - 1)  K/V read from the cache
                                   [n - 1, n)  K/V computed (the token sampled at step t - 1), stored

So the naive step t computes P + t rows of K/V and the cached one 1 (after the prefill's P). A row is
one position's K and V in every layer and KV head: 2 x layers x kv_heads x head_dim numbers. Attention
scores are counted per query head and layer as the engine computes them: the naive step fills the
n x n grid (the causal mask hides the upper half after the product), the prefill a P x P grid, a
cached decode step one row of n.

The functions here are pure; the picture and the widget only call them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minikv.model.shapes import format_bytes
from minikv.viz.view import view

NOT_YET, READ, COMPUTED = 0, 1, 2  # what a step does with one position's K/V (the grid's cell values)
FIGSIZE, DPI = (9.0, 3.4), 100  # one picture size for every step: the widget never changes height


@dataclass(frozen=True)
class KVRowShape:
    """The numbers of an engine that price one K/V row (one position, all layers)."""

    name: str
    num_layers: int
    num_heads: int  # query heads: each one scores every key of its KV head
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # bytes per stored number in the engine's cache

    @classmethod
    def from_llm(cls, llm) -> "KVRowShape":
        """The shape of `llm`'s model, and the dtype its KV cache stores (the model's, or the paged
        pool's kv_cache_dtype; an 8-bit pool's scales are not counted, minikv.viz.kv_budget prices them)."""
        c = llm.config
        return cls(name=str(llm.loaded.source), num_layers=c.num_layers,
                   num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   dtype_bytes=llm.engine_config.kv_dtype.itemsize)

    @property
    def bytes_per_row(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per number."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class KVStep:
    """One generation step: the positions whose K/V it computes and those it reads from a cache."""

    step: int
    seq_len: int  # n = P + step: the positions this step's new token attends over
    computed: range
    read: range
    scores: int  # attention scores per query head and layer

    @property
    def rows_computed(self) -> int:
        return len(self.computed)


def kv_steps(prompt_len: int, num_new_tokens: int, cached: bool) -> list[KVStep]:
    """The N steps of a generation of `num_new_tokens` after `prompt_len` tokens, naive or cached."""
    if prompt_len < 1 or num_new_tokens < 1:
        raise ValueError(f"a generation needs a prompt of at least 1 token and at least 1 new token, got "
                         f"prompt_len={prompt_len}, num_new_tokens={num_new_tokens}")
    steps = []
    for t in range(num_new_tokens):
        n = prompt_len + t
        if not cached:
            steps.append(KVStep(t, n, range(0, n), range(0, 0), n * n))
        elif t == 0:
            steps.append(KVStep(t, n, range(0, n), range(0, 0), n * n))  # the prefill: a P x P grid
        else:
            steps.append(KVStep(t, n, range(n - 1, n), range(0, n - 1), n))  # one query row over n keys
    return steps


@dataclass(frozen=True)
class Totals:
    """Running totals over steps 0..step."""

    rows_computed: int
    scores: int  # per query head and layer
    rows_held: int  # rows in the cache after the step (0 for the naive engine, which keeps none)


def running_totals(steps: list[KVStep], step: int, cached: bool) -> Totals:
    """What steps 0..`step` computed in all, and what the cache holds after `step`."""
    if not 0 <= step < len(steps):
        raise ValueError(f"step {step} is outside this generation's steps 0..{len(steps) - 1}")
    done = steps[: step + 1]
    return Totals(sum(s.rows_computed for s in done), sum(s.scores for s in done),
                  steps[step].seq_len if cached else 0)


def kv_grid(prompt_len: int, num_new_tokens: int, cached: bool, upto: int) -> np.ndarray:
    """[steps, positions] of NOT_YET / READ / COMPUTED for steps 0..`upto` (later steps stay NOT_YET).
    Positions run to P + N - 1: the last sampled token is never run, so its K/V are never needed."""
    grid = np.full((num_new_tokens, prompt_len + num_new_tokens - 1), NOT_YET, dtype=np.int8)
    for s in kv_steps(prompt_len, num_new_tokens, cached)[: upto + 1]:
        grid[s.step, s.read.start:s.read.stop] = READ
        grid[s.step, s.computed.start:s.computed.stop] = COMPUTED
    return grid


def _span(r: range) -> str:
    return f"[{r.start}, {r.stop})"


def recompute_lines(shape: KVRowShape, prompt_len: int, num_new_tokens: int, step: int, cached: bool,
                    tokens: list[str] | None = None) -> list[str]:
    """The widget's words for `step`: what it computes and reads, and the running totals (tests read them).
    `tokens`: the text of every position, prompt then new tokens (optional)."""
    steps = kv_steps(prompt_len, num_new_tokens, cached)
    s, total = steps[step], running_totals(steps, step, cached)
    other = running_totals(kv_steps(prompt_len, num_new_tokens, not cached), step, not cached)
    naive, cache = (other, total) if cached else (total, other)
    n = s.seq_len
    sampled = f" {tokens[n]!r}" if tokens else ""
    kind = "prefill" if step == 0 else "decode"
    lines = [f"step {step} of {num_new_tokens} ({kind if cached else 'naive'}): the sequence has n = {prompt_len} + "
             f"{step} = {n} positions; this step samples new token {step}{sampled}"]
    if not cached:
        lines.append(f"naive: computes the K/V of positions {_span(s.computed)} = {s.rows_computed} rows again, reads "
                     "none from a cache: it keeps none")
    elif step == 0:
        lines.append(f"cached: the prefill computes the K/V of positions {_span(s.computed)} = {s.rows_computed} rows "
                     "and stores them")
    else:
        new = f" (token {tokens[n - 1]!r})" if tokens else ""
        lines.append(f"cached: computes the K/V of position {n - 1} = 1 row{new}, reads {_span(s.read)} = "
                     f"{len(s.read)} rows from the cache")
    grids = shape.num_layers * shape.num_heads  # one score grid per query head and layer
    lines += [
        f"K/V rows computed, steps 0..{step}: {total.rows_computed:,}  (naive {naive.rows_computed:,} / cached "
        f"{cache.rows_computed:,} = {naive.rows_computed / cache.rows_computed:.1f}x)",
        f"attention scores, steps 0..{step}: {total.scores:,} per head and layer x {shape.num_layers} layers x "
        f"{shape.num_heads} heads = {total.scores * grids:,}",
        f"one row: 2 x {shape.num_layers} layers x {shape.num_kv_heads} kv heads x {shape.head_dim} x "
        f"{shape.dtype_bytes} B = {format_bytes(shape.bytes_per_row)} ({shape.name})",
    ]
    if cached:
        held = total.rows_held * shape.bytes_per_row
        lines.append(f"cache held after this step: {total.rows_held} rows = {format_bytes(held)}")
    else:
        lines.append(f"cache held after this step: 0 B; the step built {n} rows "
                     f"({format_bytes(n * shape.bytes_per_row)}) and threw them away")
    return lines


def plot_recompute(prompt_len: int, num_new_tokens: int, cached: bool, step: int, ax=None):
    """The grid of steps (rows) x positions (columns): computed, read from the cache, not yet; the
    selected step outlined. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    grid = kv_grid(prompt_len, num_new_tokens, cached, step)
    colors = ["#eeeeee", "tab:blue", "tab:orange"]  # NOT_YET, READ, COMPUTED
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    ax.add_patch(Rectangle((-0.5, step - 0.5), grid.shape[1], 1, fill=False, edgecolor="black", lw=1.5))
    ax.axvline(prompt_len - 0.5, color="black", lw=1, ls="--")
    ax.set_xlabel(f"position (prompt [0, {prompt_len}) | new tokens after the dashed line)")
    ax.set_ylabel("step")
    ax.set_title(("cached (rung 2)" if cached else "naive (rung 1)") + f": K/V per position, steps 0..{step}",
                 fontsize=10)
    ax.legend(handles=[Patch(color=colors[COMPUTED], label="K/V computed"),
                       Patch(color=colors[READ], label="K/V read\nfrom the cache"),
                       Patch(color=colors[NOT_YET], label="not run\n(or not yet)", ec="gray")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def recompute_widget(llm, prompt_token_ids: list[int], output_token_ids: list[int], cached: bool = False,
                     step: int | None = None):
    """A slider over the steps of one generation (`prompt_token_ids`, then `output_token_ids`, as `llm`
    produced them) and a toggle naive / cached: the grid of what each step computes and reads, and the
    running totals priced with `llm`'s model and cache dtype. It opens at `step` (default: the last, so
    a saved notebook shows the whole run). Everything is read now: nothing outside the widget can
    change what it shows."""
    import ipywidgets as w

    from minikv.viz.pool import figure_png

    shape = KVRowShape.from_llm(llm)
    ids = [int(i) for i in prompt_token_ids] + [int(i) for i in output_token_ids]
    P, N = len(prompt_token_ids), len(output_token_ids)
    tok = llm.tokenizer
    tokens = [tok.decode([i]) for i in ids] if tok is not None else [str(i) for i in ids]
    step = N - 1 if step is None else step
    running_totals(kv_steps(P, N, cached), step, cached)  # refuse an empty prompt or answer, or a bad step, now

    slider = w.IntSlider(value=step, min=0, max=N - 1, description="step", continuous_update=False)
    mode = w.ToggleButtons(options=[("naive (rung 1)", False), ("cached (rung 2)", True)], value=cached)
    px = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
    image = w.Image(format="png", layout=w.Layout(width=f"{px[0]}px", height=f"{px[1]}px"))
    text = w.HTML()

    def lines() -> list[str]:
        return recompute_lines(shape, P, N, slider.value, mode.value, tokens)

    def update(_=None):
        image.value = figure_png(plot_recompute(P, N, mode.value, slider.value), tight=False)
        text.value = "<pre style='font-size:12px'>" + "\n".join(lines()) + "</pre>"

    slider.observe(update, names="value")
    mode.observe(update, names="value")
    update()
    return view([w.HBox([slider, mode]), image, text],
                f"a slider over the {N} steps of a generation after a {P}-token prompt, naive or cached",
                details=lambda: "\n".join(lines()), picture=lambda: image.value)
