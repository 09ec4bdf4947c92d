"""Pictures of static batching (rung 3): each batch as a grid of slots x columns, and where the
computed tokens went (useful prompt, useful decode, prompt padding, idle decode rows).

    plot_batch_grid(stats)            one panel per batch, one coloured cell per token computed
    plot_waste({"bs 4": stats, ...})  stacked bars: tokens computed, split by what they served
    batch_grid_browser(stats)         a slider over the batches of a run (ipywidgets)
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minikv.engine.static_batching import CELL_NAMES, DECODE, EMPTY, IDLE, PAD, PROMPT, StaticBatchStats
from minikv.viz.view import view

CELL_COLORS = {EMPTY: "#ffffff", PAD: "#c8c8c8", PROMPT: "#4c78a8", DECODE: "#59a14f", IDLE: "#e15759"}
_CMAP = ListedColormap([CELL_COLORS[k] for k in sorted(CELL_COLORS)])


def _draw_trace(ax, trace, title: str) -> None:
    ax.imshow(trace.cells, cmap=_CMAP, vmin=0, vmax=len(CELL_COLORS) - 1, aspect="auto", interpolation="nearest")
    rows, cols = trace.cells.shape
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    ax.axvline(trace.prompt_len - 0.5, color="black", linewidth=1.5)  # prefill | decode
    ax.set_yticks(range(rows), [f"slot {r}" for r in range(rows)])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("column (prefill | one decode step per column)", fontsize=8)


def plot_batch_grid(stats: StaticBatchStats, axes=None, max_batches: int = 4):
    """Draw the first `max_batches` batches of a run, one panel each, widths in proportion."""
    traces = stats.traces[:max_batches]
    if axes is None:
        widths = [t.cells.shape[1] for t in traces]
        fig, axes = plt.subplots(1, len(traces), figsize=(min(16, 2 + 0.12 * sum(widths)), 1 + 0.45 * stats.batch_size),
                                 gridspec_kw={"width_ratios": widths}, squeeze=False)
        axes = axes[0]
    for b, (ax, t) in enumerate(zip(axes, traces)):
        _draw_trace(ax, t, f"batch {b}: requests {t.request_indices}")
        if b:
            ax.set_yticklabels([])
    handles = [Patch(color=CELL_COLORS[k], label=CELL_NAMES[k]) for k in (PROMPT, PAD, DECODE, IDLE, EMPTY)]
    handles[-1].set_edgecolor("black")
    axes[-1].figure.legend(handles=handles, loc="upper center", ncol=5, fontsize=8, frameon=False,
                           bbox_to_anchor=(0.5, 1.08))
    axes[-1].figure.tight_layout()
    return axes


def plot_waste(runs: dict[str, StaticBatchStats], ax=None):
    """Stacked bars: every token the model computed, split into useful and wasted kinds."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.55 * len(runs)))
    names = list(runs)
    parts = [("prompt", "prompt_tokens", PROMPT), ("useful decode", "decode_tokens", DECODE),
             ("prompt padding", "prompt_pad_tokens", PAD), ("idle decode", "idle_decode_tokens", IDLE)]
    left = np.zeros(len(names))
    for label, attr, kind in parts:
        vals = np.array([getattr(runs[n], attr) for n in names], dtype=float)
        ax.barh(names, vals, left=left, color=CELL_COLORS[kind], label=label)
        left += vals
    for i, n in enumerate(names):
        s = runs[n]
        ax.text(left[i], i, f"  waste {s.waste_fraction:.0%}, slots busy {s.slot_utilisation:.0%}", va="center",
                fontsize=8)
    ax.set_xlim(0, left.max() * 1.45)
    ax.invert_yaxis()
    ax.set_xlabel("tokens computed")
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return ax


def batch_grid_browser(stats: StaticBatchStats):
    """A slider over the batches of one run; each position redraws that batch's grid."""
    import ipywidgets as widgets

    from minikv.viz.pool import figure_png

    slider = widgets.IntSlider(0, 0, len(stats.traces) - 1, description="batch", continuous_update=False)
    image = widgets.Image(format="png")

    def show(change=None) -> None:
        t = stats.traces[slider.value]
        fig, ax = plt.subplots(figsize=(min(14, 2 + 0.15 * t.cells.shape[1]), 1 + 0.45 * stats.batch_size))
        _draw_trace(ax, t, f"batch {slider.value}: requests {t.request_indices}, generated {t.generated}")
        image.value = figure_png(fig)

    slider.observe(show, names="value")
    show()
    return view([slider, image], f"a slider over the {len(stats.traces)} batches of this run, one grid each",
                details=lambda: f"showing batch {slider.value}", picture=lambda: image.value)
