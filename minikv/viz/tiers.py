"""Where each block of each conversation lives: the pool, the CPU tier, the disk tier, or nowhere.

`tier_snapshot` reads a real engine (`LLM(..., prefix_caching="hash", kv_offload_...)`) after a
request: for every conversation it is given, the hash chain keys of its history, looked up in the
pool's table, the CPU tier and the disk tier (without changing any LRU order):

    user 0   [P P P C C D D . ]    block i of the history: P pool, C CPU tier, D disk, . gone
    user 1   [P P P P          ]   (a cell shows every tier holding the block, top to bottom)

`plot_tiers` draws one snapshot, `tiers_widget` steps through a run with a slider.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from minikv.cache.prefix.hash_chain import block_hashes
from minikv.cache.tiers.block_file import file_bytes
from minikv.viz.pool import figure_png
from minikv.viz.view import view

TIERS = ("pool", "cpu", "disk")
COLORS = {"pool": "#4c72b0", "cpu": "#dd8452", "disk": "#55a868", "gone": "#eeeeee"}


@dataclass
class TierSnapshot:
    label: str
    rows: dict[str, list[tuple[bool, bool, bool]]]  # conversation -> per block: (in pool, in CPU tier, on disk)
    hits: dict[str, int] = field(default_factory=dict)  # tokens of the last request served by each tier
    computed: int = 0  # prompt tokens of the last request that went through the model
    occupancy: dict[str, tuple[int, int]] = field(default_factory=dict)  # tier -> (blocks held, capacity)


def tier_snapshot(llm, conversations: dict[str, list[int]], label: str = "", last=None,
                  salts: dict[str, str | None] | None = None) -> TierSnapshot:
    """Where every full block of each conversation's tokens is now. `last`: the RequestOutput of the
    request just run (its hits per tier come from the engine's counters, see `run_turn`)."""
    view = llm.view
    cache, store, bs = llm.prefix_cache, view.offload_store, llm.block_size
    if getattr(store, "disk", None) is not None:
        store.disk.flush()
    rows = {}
    for name, tokens in conversations.items():
        salt = (salts or {}).get(name)
        row = []
        for h in block_hashes(tokens, bs, salt):
            k = view.tier_key(h)
            in_cpu = k is not None and getattr(store, "cpu", None) is not None and k in store.cpu
            on_disk = k is not None and getattr(store, "disk", None) is not None and k in store.disk
            row.append((h in cache.table, in_cpu, on_disk))
        rows[name] = row
    occ = {"pool": (len(cache.cached_blocks()), view.num_blocks)}
    if getattr(store, "cpu", None) is not None:
        occ["cpu"] = (len(store.cpu), store.cpu.capacity)
    if getattr(store, "disk", None) is not None:
        occ["disk"] = (len(store.disk), store.disk.budget // file_bytes(view.block_bytes))
    return TierSnapshot(label, rows, occupancy=occ)


def run_turn(llm, conversations: dict[str, list[int]], user: str, prompt: list[int], params, label: str = ""):
    """Run one request of `user` (its prompt is its whole history), append the answer to its history,
    and snapshot. Returns (snapshot, output)."""
    before = dict(llm.stats()["prefix_cache"].get("hits_by_tier", {}))
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    after = llm.stats()["prefix_cache"].get("hits_by_tier", {})
    conversations[user] = prompt + out.token_ids
    snap = tier_snapshot(llm, conversations, label or f"{user}: {len(prompt)}-token prompt")
    snap.hits = {t: after.get(t, 0) - before.get(t, 0) for t in after if after.get(t, 0) - before.get(t, 0)}
    snap.computed = len(prompt) - out.num_cached_tokens
    return snap, out


def tier_lines(snap: TierSnapshot) -> list[str]:
    """The snapshot in words: one row per conversation, one character per block (P, C, D: the top
    tier holding it; '.' nowhere), then the last request's hits and the tiers' fill."""
    lines = [snap.label]
    if snap.hits or snap.computed:
        served = ", ".join(f"{t} {n}" for t, n in snap.hits.items()) or "nothing"
        lines.append(f"  last request: served from {served} tokens; computed {snap.computed}")
    for name, row in snap.rows.items():
        marks = "".join("P" if p else "C" if c else "D" if d else "." for p, c, d in row)
        lines.append(f"  {name:>8} [{marks}]")
    lines.append("  blocks held / room: " + ", ".join(f"{t} {n:,}/{cap:,}" for t, (n, cap) in snap.occupancy.items())
                 + (" (the disk's room: kv_offload_disk_bytes, 1 GiB by default, over one file's size)"
                    if "disk" in snap.occupancy else ""))
    return lines


def plot_tiers(snap: TierSnapshot, ax=None, max_blocks: int | None = None):
    """One row per conversation, one cell per block; each cell split in three bands, top to bottom
    pool / CPU / disk, coloured where that tier holds the block."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    width = max_blocks or max((len(r) for r in snap.rows.values()), default=1)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.55 * len(snap.rows) + 1.4), dpi=100)
    for y, (name, row) in enumerate(snap.rows.items()):
        for x, held in enumerate(row[:width]):
            for band, (tier, there) in enumerate(zip(TIERS, held)):
                ax.add_patch(Rectangle((x, -y - band / 3), 0.92, 0.3, color=COLORS[tier] if there else COLORS["gone"]))
        ax.text(-0.5, -y - 0.33, name, ha="right", va="center", fontsize=9)
    ax.set_xlim(-4, width + 0.5)
    ax.set_ylim(-len(snap.rows) + 0.3, 0.5)
    ax.axis("off")
    occ = "   ".join(f"{t}: {n:,}/{cap:,}" for t, (n, cap) in snap.occupancy.items())
    ax.set_title(f"{snap.label}\nblocks held / room: {occ}", fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=COLORS[t], label=f"{t} (band {i + 1})") for i, t in enumerate(TIERS)],
              loc="upper right", fontsize=8, ncol=3, bbox_to_anchor=(1, 0))
    return ax


def tiers_widget(snaps: list[TierSnapshot], step: int = 0):
    """A slider over the snapshots, numbered from 1 as the requests are (`step` is the index of the one
    shown first): the picture and the rows in words."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    width = max(len(r) for s in snaps for r in s.rows.values())
    slider = w.IntSlider(value=step + 1, min=1, max=len(snaps), description="request", continuous_update=False)
    image = w.Image(format="png")
    text = w.HTML(layout=w.Layout(height="160px", overflow="auto"))

    def picture(i: int) -> bytes:
        rows = max(len(s.rows) for s in snaps)
        fig, ax = plt.subplots(figsize=(10, 0.55 * rows + 1.4), dpi=100)
        plot_tiers(snaps[i], ax, max_blocks=width)
        return figure_png(fig, tight=False)

    def update(_=None):
        image.value = picture(slider.value - 1)
        words = "\n".join(tier_lines(snaps[slider.value - 1]))
        text.value = "<pre style='font-size:12px; margin:0'>" + html.escape(words) + "</pre>"

    slider.observe(update, names="value")
    update()
    return view([slider, image, text], f"a slider over the {len(snaps)} requests of this run",
                details=lambda: "\n".join(tier_lines(snaps[slider.value - 1])), picture=lambda: image.value)
