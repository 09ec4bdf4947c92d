"""Watch what each program of the paged decode kernel reads: which split loads which block.

    pool      [ s0 | free | s1 | s0 | ... ]      one cell per physical block: its owner's colour, the split
                                                 whose program loaded it ("sN"), or "free"
    seq 0     [ blk 0 s0 ]                       each sequence's logical blocks in order, as the block
    seq 2     [ blk 12 s0 | blk 10 s0 | ... s1 ] table lists them, with the split that read each one

The kernel runs with `trace=`: every program writes its split id into the entries of the block table
it loaded (`minikv/kernels/decode_attention.py`), so the picture is the kernel's own account, not a guess.
`split_reads_widget` takes every tensor it draws as an argument and copies them when it is built: its
controls (split count, tile size) never read a notebook's variables, so later cells cannot break it.
"""
from __future__ import annotations

import torch

FIGSIZE, DPI = (10, 3.8), 100  # one fixed size: the widget's picture never changes height


def split_reads(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, num_splits: int, tile: int) -> torch.Tensor:
    """trace[b, kv_head, i] = the split whose program read logical block i of sequence b (-1: not read).

    q [B, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables [B, width] (-1 = no block); seq_lens [B]."""
    from minikv.kernels import paged_decode_attention

    trace = torch.full((block_tables.shape[0], k_cache.shape[2], block_tables.shape[1]), -1, dtype=torch.int32)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits,
                           block_n=tile, trace=trace)
    return trace


def plot_split_reads(trace: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int], num_blocks: int,
                     num_splits: int, tile: int):
    """Top: the pool, each block coloured by its sequence and labelled with the split that read it.
    Bottom: each sequence's logical blocks in order. Darker = odd split, lighter = even split."""
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    tables = [[int(b) for b in row if b >= 0] for row in block_tables.tolist()]
    B, width = len(tables), block_tables.shape[1]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=FIGSIZE, dpi=DPI, gridspec_kw={"height_ratios": [1, 1.7]})
    owner = {blk: b for b, t in enumerate(tables) for blk in t}
    logical = {blk: i for t in tables for i, blk in enumerate(t)}
    for blk in range(num_blocks):
        b = owner.get(blk)
        split = int(trace[b, 0, logical[blk]]) if b is not None else -1
        top.add_patch(plt.Rectangle((blk, 0), 0.92, 0.9, color=colors[b % 10] if b is not None else "0.9",
                                    alpha=0.35 + 0.65 * (split % 2) if b is not None else 1))
        top.text(blk + 0.46, 0.45, f"s{split}" if b is not None else "free", ha="center", va="center", fontsize=8)
    top.set_xlim(0, num_blocks)
    top.set_ylim(0, 1)
    top.set_yticks([])
    top.set_xticks([i + 0.46 for i in range(num_blocks)], range(num_blocks), fontsize=7)
    top.set_title(f"the pool: who reads each block (sN = split N), num_splits={num_splits}, tile={tile} positions",
                  fontsize=9)
    for b, t in enumerate(tables):
        for i, blk in enumerate(t):
            split = int(trace[b, 0, i])
            bottom.add_patch(plt.Rectangle((i, B - 1 - b), 0.92, 0.85, color=colors[b % 10],
                                           alpha=0.35 + 0.65 * (split % 2)))
            bottom.text(i + 0.46, B - 1 - b + 0.42, f"blk {blk}\ns{split}", ha="center", va="center", fontsize=7)
    bottom.set_xlim(0, width)
    bottom.set_ylim(0, B)
    bottom.set_yticks([B - 1 - b + 0.42 for b in range(B)], [f"seq {b} ({n} tok)" for b, n in enumerate(seq_lens)])
    bottom.set_xticks([i + 0.46 for i in range(width)], [f"logical {i}" for i in range(width)], fontsize=7)
    fig.tight_layout()
    return fig


def split_lines(trace: torch.Tensor, block_tables: torch.Tensor) -> list[str]:
    """Each sequence's blocks grouped by the split that read them, in words."""
    lines = []
    for b, row in enumerate(block_tables.tolist()):
        by_split: dict[int, list[int]] = {}
        for i, blk in enumerate(row):
            if blk >= 0:
                by_split.setdefault(int(trace[b, 0, i]), []).append(blk)
        lines.append(f"seq {b}: " + "; ".join(f"split {s} reads blocks {blks}" for s, blks in sorted(by_split.items())))
    return lines


def split_reads_widget(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens, scale: float, num_splits: int = 2, tile: int = 8, max_splits: int = 4,
                       tiles: tuple[int, ...] = (8, 16, 32)):
    """Sliders for the split count and the tile size; the kernel runs again at each change and the
    picture shows what each of its programs read. Every input is copied now: nothing outside the
    widget can change what it draws."""
    import ipywidgets as w

    from minikv.viz.pool import figure_png
    from minikv.viz.view import view

    q, k_cache, v_cache, block_tables = (t.detach().clone() for t in (q, k_cache, v_cache, block_tables))
    lens = torch.as_tensor(seq_lens).detach().clone()
    lens_list = [int(n) for n in lens]
    num_blocks = k_cache.shape[0]
    splits = w.IntSlider(value=num_splits, min=1, max=max_splits, description="num_splits", continuous_update=False)
    tile_box = w.Dropdown(options=list(tiles), value=tile, description="tile")
    px = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
    image = w.Image(format="png", layout=w.Layout(width=f"{px[0]}px", height=f"{px[1]}px"))
    text = w.HTML()
    state = {}

    def update(_=None):
        trace = split_reads(q, k_cache, v_cache, block_tables, lens, scale, splits.value, tile_box.value)
        state["lines"] = split_lines(trace, block_tables)
        image.value = figure_png(plot_split_reads(trace, block_tables, lens_list, num_blocks, splits.value,
                                                  tile_box.value), tight=False)
        text.value = "<pre style='font-size:12px'>" + "\n".join(state["lines"]) + "</pre>"

    splits.observe(update, names="value")
    tile_box.observe(update, names="value")
    update()
    return view([w.HBox([splits, tile_box]), image, text],
                f"the decode kernel's reads for num_splits 1-{max_splits} and tiles {list(tiles)}",
                details=lambda: f"num_splits={splits.value}, tile={tile_box.value}:\n" + "\n".join(state["lines"]),
                picture=lambda: image.value)
