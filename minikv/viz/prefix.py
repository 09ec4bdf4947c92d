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
    cache = llm.prefix_cache
    decode = _decoder(llm)
    ref = llm.view.ref_counts()

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
            boxes.append(Box(f"b{b}", f"b{parent.block}" if parent else None, [b],
                             _short(decode(e.token_ids), text_limit), len(e.token_ids), s, ref[b], e.salt,
                             e.key.hex()[:6], rank.get(b)))
    else:
        live = [n for n in cache.leaves.ordered()  # the queue may hold leaves that are busy again
                if n.is_leaf and n.blocks and cache.node_of.get(n.blocks[-1]) is n and cache.is_unused(n.blocks[-1])]
        leaves = {id(n): i + 1 for i, n in enumerate(live)}
        for node, _depth in cache.nodes():
            if node.parent is None:
                continue
            parent = None if node.parent.parent is None else f"n{id(node.parent)}"
            boxes.append(Box(f"n{id(node)}", parent, list(node.blocks), _short(decode(node.key), text_limit),
                             len(node.key), state(node.blocks), max(ref[b] for b in node.blocks), node.salt,
                             None, leaves.get(id(node))))
    pool = []
    for b in range(len(ref)):
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
    """(depth, leaves) of the drawn tree: the columns and rows it needs."""
    pos = _layout(snap.boxes)
    return (max([x for x, _ in pos.values()], default=0) + 1, max([y for _, y in pos.values()], default=0) + 1)


# One fixed scale for every picture: a column (one tree level) is COLUMN_IN inches wide, a row ROW_IN
# inches high, at DPI dots per inch, so text is the same size at every event and never shrinks to fit.
COLUMN_IN, ROW_IN, DPI = 1.18, 0.62, 100
COLUMNS = 8  # tree levels drawn at once; deeper ones are on the next page
_LEFT, _RIGHT, _TOP, _BOTTOM = 0.35, 0.55, 0.95, 1.0  # margins of a panel, in units (x: columns, y: rows)


def _panel_inches(columns: int, rows: int) -> tuple[float, float]:
    return (columns + _LEFT + _RIGHT) * COLUMN_IN, (rows + _TOP + _BOTTOM) * ROW_IN


def plot_snapshot(snap: CacheSnapshot, ax=None, columns: int | None = None, rows: int | None = None,
                  first_column: int = 0):
    """Draw the tree of one snapshot, levels [first_column, first_column + columns) of it, with the pool
    strip underneath. `columns` and `rows` fix the panel's size (default: what this tree needs, at most
    COLUMNS levels), so that every picture of a widget, and both designs side by side, share one scale."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    pos = _layout(snap.boxes)
    depth, leaves = _size(snap)
    columns = columns or min(max(depth, 4), COLUMNS)
    rows = rows or leaves
    if ax is None:
        _, ax = plt.subplots(figsize=_panel_inches(columns, rows), dpi=DPI)
    last = first_column + columns  # levels [first_column, last) are drawn
    w, h = 0.9, 0.72
    by_id = {b.id: b for b in snap.boxes}
    right: dict[int, int] = {}  # row -> boxes deeper than the last level drawn
    for box in snap.boxes:
        depth_, y = pos[box.id]
        if depth_ >= last:
            right[y] = right.get(y, 0) + 1
            continue
        if depth_ < first_column:
            continue
        x = depth_ - first_column
        top = -y - (1 - h) / 2  # rows are one unit apart, boxes h high, centred in their row
        if box.parent in pos:
            px, py = pos[box.parent]
            if px >= first_column:
                ax.plot([px - first_column + w, x], [-py - 0.5, -y - 0.5], color="#777777", lw=0.8, zorder=1)
            else:  # the parent is on the page to the left
                ax.plot([-0.2, x], [-y - 0.5, -y - 0.5], color="#777777", lw=0.8, ls=":", zorder=1)
                ax.text(-0.25, -y - 0.5, "◂", fontsize=9, ha="right", va="center", color="#555555")
        ax.add_patch(FancyBboxPatch((x, top - h), w, h, boxstyle="round,pad=0.02,rounding_size=0.05",
                                    fc=STATE_COLORS[box.state], ec="#555555", lw=0.8, zorder=2))
        if box.key:
            head = f"#{box.blocks[0]} {box.key}"
        elif len(box.blocks) <= 2:
            head = f"block{'s' if len(box.blocks) > 1 else ''} {','.join(map(str, box.blocks))}"
        else:
            head = f"{len(box.blocks)} blocks {box.blocks[0]},…"
        ax.text(x + 0.05, top - 0.22, head, fontsize=8, family="monospace", va="center", zorder=3)
        ax.text(x + 0.05, top - 0.52, _short(box.text, 16), fontsize=7.5, va="center", zorder=3, color="#333333")
        if box.evict_rank:
            ax.text(x + w - 0.04, top - 0.02, str(box.evict_rank), fontsize=7.5, color="white", ha="center",
                    va="center", zorder=4, bbox=dict(boxstyle="circle,pad=0.18", fc="#d62728", ec="none"))
        if box.salt is not None and (box.parent is None or by_id[box.parent].salt != box.salt):
            ax.text(x, top + 0.04, f"salt {box.salt!r}", fontsize=7.5, color="#7b3294", va="bottom", zorder=3)
    for y, n in right.items():
        ax.text(columns + 0.08, -y - 0.5, f"+{n} ▸", fontsize=8, ha="left", va="center", color="#555555")
    if not any(first_column <= pos[b.id][0] < last for b in snap.boxes):
        ax.text(columns / 2, -rows / 2, "nothing this deep at this event" if snap.boxes else "nothing cached",
                fontsize=9, ha="center", va="center", color="#777777")
    strip_top = -rows - 0.42
    cell = columns / max(len(snap.pool), 1)
    for b, s in enumerate(snap.pool):
        ax.add_patch(Rectangle((b * cell, strip_top - 0.4), cell * 0.9, 0.4, fc=STATE_COLORS[s], ec="#999999", lw=0.4))
    ax.text(0, strip_top + 0.06, f"the pool: {len(snap.pool)} blocks, in block order", fontsize=7.5, va="bottom")
    ax.set_xlim(-_LEFT, columns + _RIGHT)
    ax.set_ylim(-rows - _BOTTOM, _TOP)
    ax.axis("off")
    st = snap.stats
    levels = (f"; tree levels {first_column + 1}-{min(last, max(depth, first_column + 1))} of {depth}"
              if depth > columns else "")
    ax.text(-_LEFT + 0.05, _TOP - 0.05, f"{snap.design}: {snap.label}\nhit rate {st.get('hit_rate', 0):.0%} "
            f"({st.get('hits', 0)} of {st.get('queries', 0)} tokens), {st.get('evicted_blocks', 0)} evicted{levels}",
            fontsize=8.5, va="top", ha="left")
    return ax


def legend_handles():
    from matplotlib.patches import Patch

    return [Patch(fc=c, ec="#555555", label=s) for s, c in STATE_COLORS.items()]


def plot_pair(left: CacheSnapshot, right: CacheSnapshot, columns: int | None = None,
              rows: tuple[int, int] | None = None, first_column: int = 0):
    """The hash chain and the radix tree after the same request, one above the other, on one fixed scale
    (COLUMN_IN x ROW_IN inches per box, DPI): the figure's size depends only on `columns` and `rows`."""
    import matplotlib.pyplot as plt

    (d1, n), (d2, m) = _size(left), _size(right)
    columns = columns or min(max(d1, d2, 4), COLUMNS)
    n, m = rows or (n, m)
    (width, h1), (_, h2) = _panel_inches(columns, n), _panel_inches(columns, m)
    legend = 0.4
    height = h1 + h2 + legend
    fig = plt.figure(figsize=(width, height), dpi=DPI)
    top = fig.add_axes((0, (h2 + legend) / height, 1, h1 / height))
    bottom = fig.add_axes((0, legend / height, 1, h2 / height))
    plot_snapshot(left, top, columns, n, first_column)
    plot_snapshot(right, bottom, columns, m, first_column)
    fig.legend(handles=legend_handles(), loc="lower center", ncol=6, fontsize=8, frameon=False)
    return fig


def prefix_widget(left: list[CacheSnapshot], right: list[CacheSnapshot], columns: int = COLUMNS):
    """A slider over paired snapshots (the same workload on two engines), and buttons for the tree levels
    to show: both pictures and both trees in words. Every picture has the same size (the most rows any
    event needs, `columns` levels, fixed dpi), and the words scroll in a box of fixed height, so the
    widget never changes height and its text never shrinks. Returns an ipywidgets VBox."""
    import math

    import ipywidgets as w

    from minikv.viz.pool import figure_png
    from minikv.viz.view import view

    rows = (max(_size(s)[1] for s in left), max(_size(s)[1] for s in right))
    depth = max(_size(s)[0] for s in left + right)
    pages = math.ceil(depth / columns)
    slider = w.IntSlider(value=0, min=0, max=len(left) - 1, description="event", continuous_update=False,
                         layout=w.Layout(width="480px"))
    page = w.ToggleButtons(options=[(f"levels {i * columns + 1}-{min(depth, (i + 1) * columns)}", i)
                                    for i in range(pages)], value=0, description="tree")
    page.style.button_width = "110px"
    width_px = round(_panel_inches(columns, 1)[0] * DPI)
    image = w.Image(format="png", layout=w.Layout(width=f"{width_px}px"))
    text = w.HTML(layout=w.Layout(height="220px", overflow="auto", border="1px solid #ddd"))

    def update(_=None):
        a, b = left[slider.value], right[slider.value]
        image.value = figure_png(plot_pair(a, b, columns, rows, page.value * columns), tight=False)
        words = "\n".join(tree_lines(a, show_text=False) + [""] + tree_lines(b))
        text.value = "<pre style='font-size:12px; margin:0'>" + html.escape(words) + "</pre>"

    slider.observe(update, names="value")
    page.observe(update, names="value")
    update()
    controls = [slider, page] if pages > 1 else [slider]
    return view(controls + [image, text], f"a slider over {len(left)} events of the same requests on both designs",
                details=lambda: "\n".join([left[slider.value].label] + tree_lines(left[slider.value], show_text=False)
                                           + tree_lines(right[slider.value], show_text=False)),
                picture=lambda: image.value)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def plot_ttft(ttft: dict[str, list], computed: dict[str, list[int]] | None = None, ax=None,
              title: str = "time to first token"):
    """Bars of time to first token per request, one group per engine setting.

    ttft[name][i] is one time or a list of repeated times of request i: the bar is their median and the
    line through it spans their minimum and maximum. With `computed` (tokens each request ran through
    the model, per setting), a second panel below draws that count: the work, which no load on the
    machine changes, under the time, which any load does."""
    import matplotlib.pyplot as plt

    names = list(ttft)
    n = max(len(v) for v in ttft.values())
    if ax is None:
        if computed is None:
            _, ax = plt.subplots(figsize=(7, 2.8))
            work = None
        else:
            _, (ax, work) = plt.subplots(2, 1, figsize=(7, 4.6), sharex=True, height_ratios=[3, 2])
    else:
        work = None
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        runs = [t if isinstance(t, (list, tuple)) else [t] for t in ttft[name]]
        xs = [i + j * width for i in range(len(runs))]
        mids = [_median(r) for r in runs]
        bars = ax.bar(xs, mids, width=width, label=name)
        if any(len(r) > 1 for r in runs):
            ax.vlines(xs, [min(r) for r in runs], [max(r) for r in runs], color="black", lw=1)
        if work is not None:
            work.bar(xs, computed[name], width=width, color=bars.patches[0].get_facecolor())
            for x, c in zip(xs, computed[name]):
                work.text(x, c, str(c), ha="center", va="bottom", fontsize=7)
    repeats = max(len(t) if isinstance(t, (list, tuple)) else 1 for v in ttft.values() for t in v)
    ax.set_ylabel("seconds" + (f"\n(median of {repeats})" if repeats > 1 else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)  # beside the bars, never on them
    bottom = work if work is not None else ax
    bottom.set_xticks([i + 0.4 - width / 2 for i in range(n)], [f"request {i + 1}" for i in range(n)])
    if work is not None:
        work.set_ylabel("tokens computed")
        work.set_ylim(0, max(max(v) for v in computed.values()) * 1.25)
    return ax
