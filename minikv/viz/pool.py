"""Watch the paged KV pool of a REAL engine run, step by step.

`record_trace` drives an `LLM(kv_backend="paged")` with `add_request` / `step` and snapshots, at every
step, what the scheduler decided and what the block manager holds:

    step 3   pool (num_blocks cells):  [A A B . C A B . ...]     owner of each physical block
             req A  block_table [0, 1, 5]  computed 37 -> 38 tokens this step (decode)
                    position 37 -> slot = block_table[37 // 16] * 16 + 37 % 16 = 5 * 16 + 5 = 85

`plot_pool` draws one step (each block coloured by the request that owns it, shared blocks hatched,
the blocks written this step outlined), `pool_widget` steps through the whole trace with a slider,
and `plot_pool_steps` draws a few steps side by side for a notebook read without a kernel.
The recorder reads the engine, it never changes it: it wraps the scheduler's `schedule` on this one
instance to see each step's batch, and puts it back when done.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from minikv.engine.sequence import SequenceStatus
from minikv.viz.view import view


@dataclass
class SeqSnapshot:
    """One request at one step, as the scheduler left it just before the model ran."""

    request_id: str
    status: str  # "waiting" | "running" | "swapped" | "finished"
    num_prompt_tokens: int
    num_tokens: int  # prompt + generated so far
    num_computed_tokens: int  # K/V already in the pool BEFORE this step
    num_output_tokens: int
    num_preemptions: int
    block_table: list[int]
    start: int = 0  # first position run this step
    scheduled: int = 0  # tokens run this step (0: not in the batch)

    @property
    def positions(self) -> range:
        """Positions whose K/V this step writes: [start, start + scheduled)."""
        return range(self.start, self.start + self.scheduled)


@dataclass
class StepSnapshot:
    step: int
    seqs: dict[str, SeqSnapshot]  # every request that has arrived, in arrival order
    ref_count: list[int]  # block manager's reference count of each physical block
    events: list[tuple[str, str]]  # (request_id, event) logged by the scheduler during this step
    seconds: float = 0.0  # wall time of this step (schedule + model + sampling + update)
    sampled: list[str] = field(default_factory=list)  # requests that got a new token this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks of this step

    @property
    def batch(self) -> list[SeqSnapshot]:
        return [s for s in self.seqs.values() if s.scheduled]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.scheduled for s in self.seqs.values())


@dataclass
class Trace:
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    steps: list[StepSnapshot]
    request_ids: list[str]  # arrival order
    outputs: dict[str, list[int]]  # generated token ids of each request, at the end

    def __len__(self) -> int:
        return len(self.steps)

    def slots(self, step: int, request_id: str) -> list[int]:
        """Slot mapping of the tokens `request_id` runs at `step` (empty if it does not run)."""
        s = self.steps[step].seqs[request_id]
        return slot_mapping(s.block_table, list(s.positions), self.block_size)


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Physical slot of each position: block_table[p // block_size] * block_size + p % block_size."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def _status(seq) -> str:
    return {SequenceStatus.WAITING: "waiting", SequenceStatus.RUNNING: "running",
            SequenceStatus.SWAPPED: "swapped", SequenceStatus.FINISHED: "finished"}[seq.status]


def record_trace(llm, prompts: list, params=None, arrivals: list[int] | None = None,
                 max_steps: int = 10_000) -> Trace:
    """Run `prompts` through a paged `llm` and snapshot every step.

    arrivals[i] is the step at which prompt i is submitted (default: all at step 0), so a trace can
    show requests joining a batch that is already decoding. `params` is one SamplingParams or one
    per prompt. The engine's outputs are those of a plain `generate`: the recorder only watches."""
    from minikv.engine.sampling_params import SamplingParams

    if getattr(llm, "block_size", None) is None:
        raise ValueError("record_trace needs a paged engine: LLM(..., kv_backend='paged')")
    params = params if params is not None else SamplingParams()
    params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    if not (len(params) == len(arrivals) == len(prompts)):
        raise ValueError(f"got {len(prompts)} prompts, {len(params)} params and {len(arrivals)} arrival steps; "
                         "give one of each per prompt")
    view = llm.view
    known: dict[str, object] = {}  # every sequence seen, in arrival order (forked samples included)
    batches = []
    log: list[tuple[str, str]] = []  # (request_id, event) as the scheduler reports them

    class Recorder:  # an observer: the engine calls it, nothing of the engine is replaced
        def on_schedule(self, llm, batch) -> None:
            for s in view.sequences():
                known.setdefault(s.request_id, s)
            batches.append((batch, {rid: _snapshot(s) for rid, s in known.items()}, list(view.ref_counts())))

        def on_event(self, llm, step: int, request_id: str, event: str) -> None:
            log.append((request_id, event))

    remove = llm.add_observer(Recorder())
    steps, pending = [], sorted(range(len(prompts)), key=lambda i: arrivals[i])
    try:
        step = 0
        while (pending or llm.has_unfinished()) and step < max_steps:
            log_start = len(log)
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                seq = llm.add_request(prompts[i], params[i], request_id=str(i))
                known.setdefault(seq.request_id, seq)
            before = {rid: len(s.output_token_ids) for rid, s in known.items()}
            t0 = time.perf_counter()
            if llm.has_unfinished():
                llm.step()
            seconds = time.perf_counter() - t0
            copies = []
            if batches:  # the batch that ran is the last one scheduled in this step
                batch, snap, refs = batches[-1]
                for seq, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens):
                    snap[seq.request_id].start, snap[seq.request_id].scheduled = start, n
                copies = [(int(a), int(b)) for a, b in getattr(batch, "blocks_to_copy", [])]
            else:  # nothing had arrived yet: an empty step
                snap, refs = {rid: _snapshot(s) for rid, s in known.items()}, list(view.ref_counts())
            batches.clear()
            events = log[log_start:]
            sampled = [rid for rid, s in known.items() if len(s.output_token_ids) > before.get(rid, 0)]
            steps.append(StepSnapshot(step, snap, refs, events, seconds, sampled, copies))
            step += 1
    finally:
        remove()
    return Trace(view.num_blocks, llm.block_size, view.max_num_batched_tokens, steps, list(known),
                 {rid: list(s.output_token_ids) for rid, s in known.items()})


def _snapshot(seq) -> SeqSnapshot:
    return SeqSnapshot(seq.request_id, _status(seq), seq.num_prompt_tokens, seq.num_tokens, seq.num_computed_tokens,
                       len(seq.output_token_ids), seq.num_preemptions, list(seq.block_table))


# ---- what one step looks like ------------------------------------------------------------------
def block_owners(snap: StepSnapshot, num_blocks: int) -> list[list[str]]:
    """owners[b] = requests whose block table holds physical block b (two or more: a shared block)."""
    owners: list[list[str]] = [[] for _ in range(num_blocks)]
    for s in snap.seqs.values():
        for b in s.block_table:
            if b >= 0:  # -1: a block a sliding window gave back
                owners[b].append(s.request_id)
    return owners


def block_fill(trace: Trace, step: int) -> list[int]:
    """Tokens held by each physical block once this step has run (0 for a free block)."""
    fill = [0] * trace.num_blocks
    for s in trace.steps[step].seqs.values():
        held = s.num_computed_tokens + s.scheduled
        for i, b in enumerate(s.block_table):
            if b < 0:  # given back by a sliding window
                continue
            fill[b] = max(fill[b], min(trace.block_size, max(0, held - i * trace.block_size)))
    return fill


def step_lines(trace: Trace, step: int) -> list[str]:
    """The step in words: each request's state, block table, and where this step's tokens go."""
    snap = trace.steps[step]
    bs = trace.block_size
    used = sum(1 for r in snap.ref_count if r > 0)
    lines = [f"step {step}: {snap.num_batched_tokens} tokens in the batch (budget {trace.max_num_batched_tokens}), "
             f"{used}/{trace.num_blocks} blocks in use"]
    for s in snap.seqs.values():
        head = f"req {s.request_id:>2} {s.status:<8} table {s.block_table}"
        if s.scheduled:
            kind = "decode" if s.scheduled == 1 and s.num_output_tokens > 0 else "prefill"
            slots = slot_mapping(s.block_table, list(s.positions), bs)
            p = s.start
            lines.append(f"{head}  runs {s.scheduled} ({kind}) positions {s.start}..{s.start + s.scheduled - 1}")
            lines.append(f"{'':>6} slot of position {p} = table[{p} // {bs}] * {bs} + {p} % {bs} = "
                         f"{s.block_table[p // bs]} * {bs} + {p % bs} = {slots[0]}; slots {_short(slots)}")
        else:
            lines.append(f"{head}  {s.num_computed_tokens} tokens cached, not in this step's batch")
    if snap.events:
        lines.append("events: " + ", ".join(f"{rid} {ev}" for rid, ev in snap.events))
    if snap.copies:
        owner = {b: rid for rid, q in snap.seqs.items() for b in q.block_table}
        lines.append("copy-on-write: " + ", ".join(f"block {src} -> {dst} (req {owner.get(dst, '?')})"
                                                   for src, dst in snap.copies))
    return lines


def _short(xs: list[int], limit: int = 8) -> str:
    if len(xs) <= limit:
        return str(xs)
    return f"[{', '.join(map(str, xs[:limit // 2]))}, ..., {', '.join(map(str, xs[-2:]))}]"


def request_colors(request_ids: list[str]) -> dict[str, tuple]:
    """A stable colour per request (tab20), shared by the pool and the timeline."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {rid: cmap((2 * i) % 20 + (i // 10) % 2) for i, rid in enumerate(request_ids)}


def plot_pool(trace: Trace, step: int, ax=None, columns: int | None = None, title: bool = True):
    """The physical pool at `step`: one cell per block, coloured by its owner, filled to the share of
    its slots in use; hatched = shared by several block tables; thick outline = written this step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    snap = trace.steps[step]
    n = trace.num_blocks
    columns = columns or min(n, 16)
    rows = -(-n // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * columns + 1, 0.55 * rows + 0.9))
    colors = request_colors(trace.request_ids)
    owners, fill = block_owners(snap, n), block_fill(trace, step)
    written = {s.block_table[p // trace.block_size] for s in snap.batch for p in s.positions}
    for b in range(n):
        x, y = b % columns, rows - 1 - b // columns
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor="#eeeeee", edgecolor="#bbbbbb", lw=0.5))
        if owners[b]:
            share = 0.92 / len(owners[b])
            for k, rid in enumerate(owners[b]):  # a shared block: one stripe per owner
                ax.add_patch(Rectangle((x + k * share, y), share, 0.92 * fill[b] / trace.block_size,
                                       facecolor=colors[rid], edgecolor="none"))
                ax.add_patch(Rectangle((x + k * share, y), share, 0.92, facecolor=colors[rid], alpha=0.25,
                                       edgecolor="none"))
            if len(owners[b]) > 1:
                ax.add_patch(Rectangle((x, y), 0.92, 0.92, fill=False, hatch="///", edgecolor="black", lw=0))
            # a shared block says how many tables hold it, on a white patch so the hatching never hides it
            label = owners[b][0] if len(owners[b]) == 1 else f"x{len(owners[b])}"
            ax.text(x + 0.46, y + 0.4, label, ha="center", va="center", fontsize=6.5, zorder=5,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))
        ax.text(x + 0.04, y + 0.8, str(b), fontsize=5.5, color="#555555")
        if b in written:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, fill=False, edgecolor="black", lw=1.6))
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        used = sum(1 for o in owners if o)
        ax.set_title(f"step {step}: {used}/{n} blocks in use, {snap.num_batched_tokens} tokens this step",
                     fontsize=9)
    present = [rid for rid in trace.request_ids if rid in snap.seqs]
    handles = [Patch(color=colors[r], label=f"req {r}") for r in present]
    handles.append(Patch(facecolor="#eeeeee", edgecolor="#bbbbbb", label="free"))
    if any(len(o) > 1 for o in owners):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="shared (xN: N tables)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    return ax.figure


def plot_pool_steps(trace: Trace, steps: list[int], columns: int | None = None):
    """A few steps of the pool one under the other (a static view of what `pool_widget` animates)."""
    import matplotlib.pyplot as plt

    columns = columns or min(trace.num_blocks, 16)
    rows = -(-trace.num_blocks // columns)
    fig, axes = plt.subplots(len(steps), 1, figsize=(0.55 * columns + 1.8, (0.55 * rows + 0.6) * len(steps)),
                             squeeze=False)
    for ax, step in zip(axes[:, 0], steps):
        plot_pool(trace, step, ax=ax, columns=columns)
    fig.tight_layout()
    return fig


def figure_png(fig, tight: bool = True) -> bytes:
    """The figure as PNG bytes, and closed. tight=False keeps the figure's own size and dpi, so every
    picture of a widget has the same pixel size and the widget never changes height."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    if tight:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    else:
        fig.savefig(buf, format="png", dpi=fig.dpi)
    plt.close(fig)
    return buf.getvalue()


def pool_widget(trace: Trace, step: int = 0):
    """A slider over the steps of `trace`: the pool picture, and each request's block table and slot
    mapping in words. Returns an ipywidgets VBox (its `.children[0]` is the slider)."""
    import html

    import ipywidgets as w

    slider = w.IntSlider(value=step, min=0, max=len(trace) - 1, description="step", continuous_update=False)
    image = w.Image(format="png")
    text = w.HTML(layout=w.Layout(height="200px", overflow="auto"))  # a fixed height: the view never jumps

    def update(_=None):
        image.value = figure_png(plot_pool(trace, slider.value))
        lines = step_lines(trace, slider.value)
        text.value = "<pre style='font-size:12px; margin:0'>" + html.escape("\n".join(lines)) + "</pre>"

    slider.observe(update, names="value")
    update()
    return view([slider, image, text], f"a slider over the {len(trace)} steps of this run",
                details=lambda: "\n".join(step_lines(trace, slider.value)), picture=lambda: image.value)
