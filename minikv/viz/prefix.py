"""Watch a prefix cache of a REAL engine: the hash chain and the radix tree, growing and evicted.

`snapshot(llm, label)` reads the engine's prefix cache and block pool (it changes nothing) into one
picture's worth of data:

    hash chain   one box per cached block: its id, the first hex digits of its key, its tokens;
                 a line from each block to the block whose key it hashed (its parent)
    radix tree   one box per node: the tokens on its edge, its blocks; lines from parent to child
    both         colour = state (in use by a request / unused, evictable / pinned), a red number
                 = eviction order (1 goes next), and a strip of the whole pool under the tree

The hash table is flat, yet its parent keys draw the same tree the radix cache stores explicitly:
the two designs hold the same blocks, they differ in how a lookup finds them and what may go.

`run_and_snap` runs one request and snapshots it twice (prefilled, finished); `prefix_widget` steps
through snapshots of both designs side by side; `tree_lines` prints a snapshot as text; and
`hit_lines` shows, block by block, which blocks of a prompt the cache would serve.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable

STATE_COLORS = {"in use": "#8fd18f", "unused": "#fdc98a", "pinned": "#8fb8de", "unreachable": "#d9d9d9",
                "empty": "#ffffff", "in use, not cached": "#cfe8cf"}


@dataclass
class Box:
    """One block (hash chain) or one node (radix tree) as drawn."""

    id: str
    parent: str | None
    blocks: list[int]
    text: str  # the tokens it holds, decoded and shortened
    num_tokens: int
    state: str  # "in use" | "unused" | "pinned" | "unreachable"
    refs: int  # requests holding it (the largest ref_count of its blocks)
    salt: str | None
    key: str | None = None  # hash chain: first hex digits of the block's key
    evict_rank: int | None = None  # 1 = the next to be evicted


@dataclass
class CacheSnapshot:
    label: str
    design: str
    boxes: list[Box]
    pool: list[str]  # state of every physical block
    stats: dict = field(default_factory=dict)


# ---- reading the engine --------------------------------------------------------------------------
def _decoder(llm) -> Callable[[list[int]], str]:
    if llm.tokenizer is not None:
        return lambda ids: llm.tokenizer.decode(list(ids), skip_special_tokens=False)
    return lambda ids: " ".join(str(t) for t in ids)


def _short(text: str, limit: int) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def snapshot(llm, label: str = "", text_limit: int = 22) -> CacheSnapshot:
    """What the engine's prefix cache holds now, and the state of every block of the pool."""
    cache, bm = llm.prefix_cache, llm.block_manager
    decode = _decoder(llm)
    ref = bm.ref_count

    def state(blocks: list[int]) -> str:
        if any(ref[b] for b in blocks):
            return "in use"
        return "pinned" if any(b in cache.pinned for b in blocks) else "unused"

    boxes = []
    if cache.design == "hash":
        rank = {b: i + 1 for i, b in enumerate(cache.free_queue.ordered())}
        for b, e in cache.by_block.items():
            parent = cache.table.get(e.parent) if e.parent is not None else None
            s = state([b])
            if e.parent is not None and parent is None:
                s = "unreachable" if s == "unused" else s  # its parent was evicted: no lookup reaches it
            boxes.append(Box(f"b{b}", f"b{parent.block}" if parent else None, [b], _short(decode(e.token_ids), text_limit),
                             len(e.token_ids), s, ref[b], e.salt, e.key.hex()[:6], rank.get(b)))
    else:
        live = [n for n in cache.leaves.ordered()  # the queue may hold leaves that are busy again
                if n.is_leaf and n.blocks and cache.node_of.get(n.blocks[-1]) is n and cache.is_unused(n.blocks[-1])]
        leaves = {id(n): i + 1 for i, n in enumerate(live)}
        for node, depth in cache.nodes():
            if node.parent is None:
                continue
            parent = None if node.parent.parent is None else f"n{id(node.parent)}"
            boxes.append(Box(f"n{id(node)}", parent, list(node.blocks), _short(decode(node.key), text_limit),
                             len(node.key), state(node.blocks), max(ref[b] for b in node.blocks), node.salt,
                             None, leaves.get(id(node))))
    pool = []
    for b in range(bm.num_blocks):
        if cache.holds(b):
            pool.append("in use" if ref[b] else "pinned" if b in cache.pinned else "unused")
        else:
            pool.append("in use, not cached" if ref[b] else "empty")
    return CacheSnapshot(label, cache.design, boxes, pool, cache.stats())


def run_and_snap(llm, label: str, prompt, params) -> tuple:
    """Run one request alone; snapshot once its prompt is computed (its hit still in use) and once
    it has finished (its blocks unused, in eviction order). Returns (RequestOutput, [2 snapshots])."""
    seq = llm.add_request(prompt, params)
    snaps = []
    while llm.has_unfinished():
        llm.step()
        if not snaps and seq.num_computed_tokens >= seq.num_prompt_tokens:
            snaps.append(snapshot(llm, f"{label}: prompt computed, {seq.num_cached_tokens} of "
                                       f"{seq.num_prompt_tokens} tokens came from the cache"))
    snaps.append(snapshot(llm, f"{label}: finished, its blocks are unused (evictable) unless shared"))
    return llm.output(seq), snaps


# ---- text ----------------------------------------------------------------------------------------
def tree_lines(snap: CacheSnapshot, show_text: bool = True) -> list[str]:
    """The cached blocks as an indented tree, one line per box."""
    children: dict[str | None, list[Box]] = {}
    for box in snap.boxes:
        children.setdefault(box.parent, []).append(box)
    lines = [f"{snap.design}: {len(snap.boxes)} {'blocks' if snap.design == 'hash' else 'nodes'}, "
             f"{sum(len(b.blocks) for b in snap.boxes)} cached blocks"]

    def walk(parent: str | None, indent: str) -> None:
        kids = children.get(parent, [])
        for i, box in enumerate(kids):
            last = i == len(kids) - 1
            what = f"key {box.key} " if box.key else ""
            blocks = f"block {box.blocks[0]}" if len(box.blocks) == 1 else f"blocks {' '.join(map(str, box.blocks))}"
            extra = f" · evict #{box.evict_rank}" if box.evict_rank else ""
            salt = f" · salt {box.salt!r}" if box.salt is not None else ""
            text = f" {box.text!r}" if show_text else ""
            lines.append(f"{indent}{'└─' if last else '├─'} {what}{blocks}{text} · {box.state}"
                         f"{f' x{box.refs}' if box.refs > 1 else ''}{salt}{extra}")
            walk(box.id, indent + ("   " if last else "│  "))

    walk(None, "")
    return lines


def hit_lines(llm, variants: dict[str, object]) -> list[str]:
    """For each prompt, block by block: ■ the cache would serve it, □ it must be computed."""
    bs, rows = llm.block_size, []
    width = max(len(k) for k in variants)
    for name, prompt in variants.items():
        ids, _, salt = llm.encode(prompt)
        hit = llm.prefix_cache.match(ids, salt, len(ids) - 1).num_tokens // bs  # as a lookup would
        cells = "".join("■" if i < hit else "□" for i in range(len(ids) // bs))
        rows.append(f"{name:<{width}}  {cells}  {hit}/{len(ids) // bs} blocks hit")
    return rows


# ---- pictures ------------------------------------------------------------------------------------
def _layout(boxes: list[Box]) -> dict[str, tuple[float, float]]:
    """x = depth in the tree, y = leaf order (a parent sits level with its first child)."""
    children: dict[str | None, list[Box]] = {}
    for box in boxes:
        children.setdefault(box.parent, []).append(box)
    pos, row = {}, [0]

    def place(box: Box, depth: int) -> None:
        kids = children.get(box.id, [])
        pos[box.id] = (depth, row[0])
        if not kids:
            row[0] += 1
        for k in kids:
            place(k, depth + 1)

    for root in children.get(None, []):
        place(root, 0)
    return pos


def _size(snap: CacheSnapshot) -> tuple[int, int]:
    pos = _layout(snap.boxes)
    return (max([x for x, _ in pos.values()], default=0) + 1, max([y for _, y in pos.values()], default=0) + 1)


def plot_snapshot(snap: CacheSnapshot, ax=None, max_columns: int = 14, columns: int | None = None):
    """Draw the tree of one snapshot, with the pool strip underneath (`columns`: width to draw, so
    two pictures side by side share one scale)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    pos = _layout(snap.boxes)
    cols, rows = _size(snap)
    cols = min(max(columns or cols, 4), max_columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 1.9 * cols), 1.0 + 0.75 * rows))
    w, h = 0.9, 0.62
    by_id = {b.id: b for b in snap.boxes}
    hidden: dict[int, int] = {}  # row -> boxes beyond the last column drawn
    for box in snap.boxes:
        x, y = pos[box.id]
        if x >= cols:
            hidden[y] = hidden.get(y, 0) + 1
            continue
        if box.parent in pos and pos[box.parent][0] < cols:
            px, py = pos[box.parent]
            ax.plot([px + w, x], [-py - h / 2, -y - h / 2], color="#777777", lw=0.8, zorder=1)
        ax.add_patch(FancyBboxPatch((x, -y - h), w, h, boxstyle="round,pad=0.02,rounding_size=0.05",
                                    fc=STATE_COLORS[box.state], ec="#555555", lw=0.8, zorder=2))
        head = (f"#{box.blocks[0]} {box.key}" if box.key else
                f"blocks {','.join(map(str, box.blocks[:4]))}{'…' if len(box.blocks) > 4 else ''}")
        ax.text(x + 0.04, -y - 0.17, head, fontsize=6.5, family="monospace", va="center", zorder=3)
        ax.text(x + 0.04, -y - 0.42, box.text[:18], fontsize=6, va="center", zorder=3, color="#333333")
        if box.evict_rank:
            ax.text(x + w - 0.02, -y - 0.02, str(box.evict_rank), fontsize=6.5, color="white", ha="center",
                    va="center", zorder=4, bbox=dict(boxstyle="circle,pad=0.15", fc="#d62728", ec="none"))
        if box.salt is not None and (box.parent is None or by_id[box.parent].salt != box.salt):
            ax.text(x, -y + 0.06, f"salt {box.salt!r}", fontsize=6, color="#7b3294", zorder=3)
    for y, n in hidden.items():
        ax.text(cols - 0.02, -y - h - 0.08, f"… {n} more to the right", fontsize=6, ha="right", va="top", color="#555555")
    strip_y = -rows - 0.35
    cell = cols / max(len(snap.pool), 1)
    for b, s in enumerate(snap.pool):
        ax.add_patch(Rectangle((b * cell, strip_y - 0.28), cell * 0.92, 0.28, fc=STATE_COLORS[s], ec="#999999", lw=0.4))
    ax.text(0, strip_y + 0.08, f"pool: {len(snap.pool)} blocks", fontsize=6.5, va="bottom")
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(strip_y - 0.45, 0.35)
    ax.axis("off")
    st = snap.stats
    ax.set_title(f"{snap.design}: {snap.label}\nhit rate {st.get('hit_rate', 0):.0%} "
                 f"({st.get('hits', 0)} of {st.get('queries', 0)} tokens), {st.get('evicted_blocks', 0)} evicted",
                 fontsize=8, loc="left")
    return ax


def legend_handles():
    from matplotlib.patches import Patch

    return [Patch(fc=c, ec="#555555", label=s) for s, c in STATE_COLORS.items()]


def plot_pair(left: CacheSnapshot, right: CacheSnapshot):
    """The hash chain and the radix tree after the same request, one above the other."""
    import matplotlib.pyplot as plt

    (c1, n), (c2, m) = _size(left), _size(right)
    cols = min(max(c1, c2, 4), 14)
    fig, axes = plt.subplots(2, 1, figsize=(1.0 * cols + 1, 2.4 + 0.75 * (n + m)), height_ratios=[n + 1.5, m + 1.5])
    plot_snapshot(left, axes[0], columns=cols)
    plot_snapshot(right, axes[1], columns=cols)
    fig.legend(handles=legend_handles(), loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def prefix_widget(left: list[CacheSnapshot], right: list[CacheSnapshot]):
    """A slider over paired snapshots (the same workload on two engines): both pictures and both trees
    in words. Returns an ipywidgets VBox (its `.children[0]` is the slider)."""
    import ipywidgets as w

    from minikv.viz.pool import figure_png

    slider = w.IntSlider(value=0, min=0, max=len(left) - 1, description="event", continuous_update=False)
    image = w.Image(format="png")
    text = w.HTML()

    def update(_=None):
        a, b = left[slider.value], right[slider.value]
        image.value = figure_png(plot_pair(a, b))
        words = "\n".join(tree_lines(a, show_text=False) + [""] + tree_lines(b))
        text.value = "<pre style='font-size:11px'>" + html.escape(words) + "</pre>"

    slider.observe(update, names="value")
    update()
    return w.VBox([slider, image, text])


def plot_ttft(ttft: dict[str, list[float]], ax=None, title: str = "time to first token"):
    """Bars of TTFT per request, one group per engine setting."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.8))
    names = list(ttft)
    n = max(len(v) for v in ttft.values())
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(ttft[name]))]
        ax.bar(xs, ttft[name], width=width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(n)], [f"request {i + 1}" for i in range(n)])
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return ax
