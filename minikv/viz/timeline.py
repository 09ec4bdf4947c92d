"""A request's life in a recorded trace: one row per request, one column per engine step.

    req 0  PPPDDDDDDDDD.......          P prefill (or one chunk of it)   D decode
    req 1  PPPPDDDDxxxxRRRDDDD....      x preempted (recompute)  R its prompt AND output run again
    req 2  wwwwwwPPDDDDDDDsssssDDD..    w waiting for blocks / budget / a seat   s swapped to CPU
                                        . done (its blocks are back in the pool)

`request_states` turns a `Trace` (see `minikv.viz.pool.record_trace`) into these rows, `plot_timeline`
draws them (x = step, or x = wall time), and `timeline_widget` adds a slider that shows what the
scheduler put into the batch at one step. States are read from the engine's own snapshot; nothing
is inferred from timings.
"""
from __future__ import annotations

from itertools import accumulate

from minikv.viz.pool import Trace

STATES = ("waiting", "prefill", "decode", "preempted", "recompute", "swapped", "stalled", "done")
STATE_COLORS = {
    "waiting": "#d9d9d9",
    "prefill": "#1f77b4",
    "decode": "#2ca02c",
    "preempted": "#d62728",
    "recompute": "#ff7f0e",
    "swapped": "#9467bd",
    "stalled": "#bcbd22",
    "done": "#f7f7f7",
}
_LETTERS = {"waiting": "w", "prefill": "P", "decode": "D", "preempted": "x", "recompute": "R", "swapped": "s",
            "stalled": "-", "done": "."}


def request_states(trace: Trace) -> dict[str, list[str | None]]:
    """states[request_id][step]: what the request was doing at that step (None before it arrived).

    prefill   in the batch, running prompt tokens (a whole prompt or a chunk of it)
    decode    in the batch with one token, after its first generated token
    recompute in the batch again after a recompute preemption: prompt and output re-run
    waiting   arrived, not yet admitted            preempted  dropped by recompute, waiting again
    swapped   its K/V parked in CPU memory         stalled    admitted but given no token this step
    done      finished (or aborted)
    """
    states: dict[str, list[str | None]] = {rid: [None] * len(trace) for rid in trace.request_ids}
    for i, snap in enumerate(trace.steps):
        for rid, s in snap.seqs.items():
            if s.status == "finished":
                state = "done"
            elif s.scheduled:
                if s.scheduled == 1 and s.num_output_tokens > 0 and s.start == s.num_tokens - 1:
                    state = "decode"
                elif s.num_preemptions > 0 and s.start < s.num_tokens - 1 and s.num_output_tokens > 0:
                    state = "recompute"
                else:
                    state = "prefill"
            elif s.status == "swapped":
                state = "swapped"
            elif s.status == "waiting":
                state = "preempted" if s.num_preemptions > 0 else "waiting"
            else:
                state = "stalled"
            states[rid][i] = state
    return states


def state_rows(trace: Trace) -> list[str]:
    """The timeline as text, one line per request (the letters of the module docstring)."""
    width = max(len(r) for r in trace.request_ids)
    return [f"req {rid:>{width}}  " + "".join(" " if s is None else _LETTERS[s] for s in row)
            for rid, row in request_states(trace).items()]


def segments(row: list[str | None]) -> list[tuple[int, int, str]]:
    """Runs of one state: [(first step, number of steps, state)]."""
    out: list[tuple[int, int, str]] = []
    for i, s in enumerate(row):
        if s is None:
            continue
        if out and out[-1][2] == s and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1, s)
        else:
            out.append((i, 1, s))
    return out


def request_latencies(trace: Trace) -> dict[str, dict[str, float | None]]:
    """Per request, in seconds of the recorded run: arrival to first token, and to its last token."""
    ends = [0.0] + list(accumulate(s.seconds for s in trace.steps))  # ends[i] = time before step i
    out = {}
    for rid in trace.request_ids:
        arrived = next(i for i, s in enumerate(trace.steps) if rid in s.seqs)
        got = [i for i, s in enumerate(trace.steps) if rid in s.sampled]
        out[rid] = {"ttft": ends[got[0] + 1] - ends[arrived] if got else None,
                    "e2e": ends[got[-1] + 1] - ends[arrived] if got else None}
    return out


def plot_timeline(trace: Trace, ax=None, x: str = "step", title: str | None = None, mark_step: int | None = None):
    """One row per request, coloured by state; x = "step" (engine steps) or "time" (wall seconds)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    states = request_states(trace)
    starts = [0.0] + list(accumulate(s.seconds for s in trace.steps))
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.32 * len(states) + 1.3))
    used = set()
    for row, line in enumerate(states.values()):
        for first, n, state in segments(line):
            if state == "done":
                continue
            used.add(state)
            if x == "step":
                left, width = first, n
            else:
                left, width = starts[first], starts[first + n] - starts[first]
            ax.broken_barh([(left, width)], (row - 0.4, 0.8), facecolors=STATE_COLORS[state])
    if mark_step is not None:
        pos = mark_step + 0.5 if x == "step" else (starts[mark_step] + starts[mark_step + 1]) / 2
        ax.axvline(pos, color="black", lw=1, ls="--")
    ax.set_yticks(range(len(states)), [f"req {r}" for r in states])
    ax.set_ylim(len(states) - 0.5, -0.5)
    ax.set_xlim(0, len(trace) if x == "step" else starts[-1])
    ax.set_xlabel("engine step" if x == "step" else "seconds")
    ax.legend(handles=[Patch(color=STATE_COLORS[s], label=s) for s in STATES if s in used],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or f"{len(states)} requests, {len(trace)} steps, token budget {trace.max_num_batched_tokens}",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return ax.figure


def batch_lines(trace: Trace, step: int) -> list[str]:
    """What the scheduler put in the batch at `step`, in its order, and what used the budget."""
    snap = trace.steps[step]
    states = request_states(trace)
    lines = [f"step {step}: {snap.num_batched_tokens} of {trace.max_num_batched_tokens} budget tokens, "
             f"{len(snap.batch)} sequences in the batch"]
    for s in snap.batch:
        unit = "token " if s.scheduled == 1 else "tokens"
        lines.append(f"  req {s.request_id}: {s.scheduled:>4} {unit} ({states[s.request_id][step]}, "
                     f"positions {s.start}..{s.start + s.scheduled - 1})")
    waiting = [rid for rid, row in states.items() if row[step] in ("waiting", "preempted", "swapped", "stalled")]
    if waiting:
        lines.append("  not in the batch: " + ", ".join(f"req {r} ({states[r][step]})" for r in waiting))
    if snap.events:
        lines.append("  events: " + ", ".join(f"req {rid} {ev}" for rid, ev in snap.events))
    return lines


def timeline_widget(trace: Trace, x: str = "step"):
    """The timeline with a slider: a dashed line at the chosen step and that step's batch in words."""
    import html

    import ipywidgets as w

    from minikv.viz.pool import figure_png
    from minikv.viz.view import view

    slider = w.IntSlider(value=0, min=0, max=len(trace) - 1, description="step", continuous_update=False)
    image = w.Image(format="png")
    text = w.HTML(layout=w.Layout(height="180px", overflow="auto"))  # a fixed height: the view never jumps

    def update(_=None):
        image.value = figure_png(plot_timeline(trace, x=x, mark_step=slider.value))
        lines = batch_lines(trace, slider.value)
        text.value = "<pre style='font-size:12px; margin:0'>" + html.escape("\n".join(lines)) + "</pre>"

    slider.observe(update, names="value")
    update()
    return view([slider, image, text], f"a slider over the {len(trace)} steps of this timeline",
                details=lambda: "\n".join(batch_lines(trace, slider.value)), picture=lambda: image.value)
