"""The pool and timeline views read a real engine run correctly, and draw without a display."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from minikv import LLM, SamplingParams
from minikv.viz.pool import (
    block_fill,
    block_owners,
    plot_pool,
    plot_pool_steps,
    pool_widget,
    record_trace,
    slot_mapping,
    step_lines,
)
from minikv.viz.timeline import (
    batch_lines,
    plot_timeline,
    request_latencies,
    request_states,
    segments,
    state_rows,
    timeline_widget,
)

PROMPTS = [[(5 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 14, 5, 10, 7))]
PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)


def paged(**kw) -> LLM:
    args = dict(kv_backend="paged", num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    return LLM("tiny-random", **(args | kw))


@pytest.fixture(scope="module")
def trace():
    return record_trace(paged(), PROMPTS, PARAMS, arrivals=[0, 0, 2, 5, 9])


@pytest.fixture(scope="module", params=["recompute", "swap"])
def pressure_trace(request):
    return record_trace(paged(num_blocks=12, preemption=request.param), PROMPTS, PARAMS, arrivals=[0, 0, 2, 5, 9])


def test_recording_does_not_change_what_the_engine_generates(trace):
    outputs = paged().generate(PROMPTS, PARAMS)
    assert [trace.outputs[str(i)] for i in range(len(PROMPTS))] == [o.token_ids for o in outputs]


def test_recorder_only_observes_and_leaves_the_engine_as_it_was():
    llm = paged()
    before = dict(vars(llm.scheduler)), dict(vars(llm.runner))
    record_trace(llm, PROMPTS[:2], PARAMS)
    assert "schedule" not in vars(llm.scheduler) and "step" not in vars(llm)
    assert set(vars(llm.scheduler)) == set(before[0]) and set(vars(llm.runner)) == set(before[1])
    assert llm.core._observers == []  # the recorder removed itself


def test_requests_arrive_at_their_step(trace):
    first_seen = {rid: next(i for i, s in enumerate(trace.steps) if rid in s.seqs) for rid in trace.request_ids}
    assert first_seen == {"0": 0, "1": 0, "2": 2, "3": 5, "4": 9}


def test_every_step_respects_the_token_budget_and_block_tables_cover_the_tokens(trace):
    for snap in trace.steps:
        assert snap.num_batched_tokens <= trace.max_num_batched_tokens
        for s in snap.batch:
            assert len(s.block_table) * trace.block_size >= s.start + s.scheduled


def test_snapshot_slots_are_the_engines_slot_mapping(trace):
    for step, snap in enumerate(trace.steps):
        for s in snap.batch:
            slots = trace.slots(step, s.request_id)
            assert slots == slot_mapping(s.block_table, list(s.positions), trace.block_size)
            assert len(set(slots)) == len(slots)


def test_no_block_has_two_owners_without_sharing(trace):
    for snap in trace.steps:
        owners = block_owners(snap, trace.num_blocks)
        assert all(len(o) <= 1 for o in owners)
        assert [len(o) for o in owners] == snap.ref_count


def test_block_fill_counts_the_tokens_in_the_pool(trace):
    for step, snap in enumerate(trace.steps):
        live = [s for s in snap.seqs.values() if s.block_table]
        assert sum(block_fill(trace, step)) == sum(s.num_computed_tokens + s.scheduled for s in live)


def test_step_lines_spell_out_the_slot_arithmetic(trace):
    text = "\n".join(step_lines(trace, 1))
    assert "slot of position" in text and "table[" in text and "step 1" in text


def test_timeline_states_follow_a_request_life(trace):
    states = request_states(trace)
    for rid, row in states.items():
        seen = [s for s in row if s is not None]
        assert seen[0] in ("waiting", "prefill")
        assert "decode" in seen and seen[-1] in ("decode", "done")
        first_decode = seen.index("decode")
        assert "prefill" not in seen[first_decode:], f"req {rid}: prefill after decode without a preemption"
    assert states["3"][:5] == [None] * 5


def test_segments_join_runs_of_one_state():
    assert segments([None, "waiting", "waiting", "prefill", "decode", "decode"]) == [
        (1, 2, "waiting"), (3, 1, "prefill"), (4, 2, "decode")]


def test_memory_pressure_shows_up_as_preempted_or_swapped(pressure_trace):
    states = {s for row in request_states(pressure_trace).values() for s in row}
    assert states & {"preempted", "swapped"}, states
    if "preempted" in states:
        assert "recompute" in states  # a preempted request with outputs re-runs prompt + output


def test_latencies_are_positive_and_ordered(trace):
    for lat in request_latencies(trace).values():
        assert 0 < lat["ttft"] <= lat["e2e"]


def test_text_views(trace):
    rows = state_rows(trace)
    assert len(rows) == 5 and rows[0].startswith("req 0")
    assert "budget" in batch_lines(trace, 3)[0]


def test_plots_draw_without_a_display(trace, pressure_trace):
    import matplotlib.pyplot as plt

    for fig in (plot_pool(trace, 4), plot_pool_steps(trace, [0, 5, 10]), plot_timeline(trace),
                plot_timeline(pressure_trace, x="time", mark_step=3)):
        assert fig.axes
        plt.close(fig)
    with pytest.raises(ValueError, match="x must be"):
        plot_timeline(trace, x="tokens")


def test_widgets_update_when_the_slider_moves(trace):
    for make in (pool_widget, timeline_widget):
        w = make(trace)
        slider, image, text = w.children
        first_text, first_png = text.value, image.value
        slider.value = 6
        assert "step 6" in text.value and text.value != first_text and image.value != first_png


def test_record_trace_refuses_a_contiguous_engine():
    with pytest.raises(ValueError, match="paged"):
        record_trace(LLM("tiny-random", kv_backend="contiguous"), PROMPTS[:1], PARAMS)


def test_blocks_shared_by_forked_samples_have_every_owner():
    llm = paged()
    trace = record_trace(llm, [PROMPTS[1]], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=1,
                                                          ignore_eos=True))
    shared = [(i, b) for i, snap in enumerate(trace.steps) for b, r in enumerate(snap.ref_count) if r > 1]
    if not shared:
        pytest.skip("this engine does not share blocks between parallel samples")
    step, block = shared[0]
    owners = block_owners(trace.steps[step], trace.num_blocks)[block]
    assert len(owners) == trace.steps[step].ref_count[block] and len(trace.request_ids) == 2
    import matplotlib.pyplot as plt

    plt.close(plot_pool(trace, step))  # the hatched "shared" legend entry is drawn


def _decode_batch(seed: int = 0):
    """Notebook 08's batch: three sequences of 5, 24 and 43 tokens in blocks of 8, scattered over 20."""
    import torch

    from minikv.kernels import store_kvcache

    g = torch.Generator().manual_seed(seed)
    block_size, num_blocks, kv_heads, group, head_dim = 8, 20, 2, 3, 16
    seq_lens = [5, 24, 43]
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    for b, n in enumerate(seq_lens):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(n)])
        store_kvcache(torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g),
                      k_cache, v_cache, slots)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens), head_dim**-0.5


def test_split_reads_follow_the_split_count_and_cover_every_block_once():
    from minikv.viz.decode import split_lines, split_reads

    q, k, v, tables, lens, scale = _decode_batch()
    one = split_reads(q, k, v, tables, lens, scale, num_splits=1, tile=8)
    assert ((one == 0) == (tables >= 0)[:, None, :]).all()  # one split reads every block, nothing else
    four = split_reads(q, k, v, tables, lens, scale, num_splits=4, tile=8)
    longest = four[2, 0][tables[2] >= 0].tolist()
    assert longest == sorted(longest) and len(set(longest)) > 2  # ranges in order, several programs
    assert "split 1 reads" in "\n".join(split_lines(split_reads(q, k, v, tables, lens, scale, 2, 8), tables))


def test_split_reads_widget_reads_no_caller_variable_after_it_is_built():
    """Notebook 08 after Run All: later cells rebind `width` and friends; the widget must not care."""
    from minikv.viz.decode import split_reads_widget

    q, k, v, tables, lens, scale = _decode_batch()
    widget = split_reads_widget(q, k, v, tables, lens, scale)
    controls, image, text = widget.children
    splits, tile = controls.children
    first_text, first_png = text.value, image.value
    k.fill_(float("nan"))  # the caller's tensors change (or their names are rebound): the view keeps its copies
    tables.zero_()
    width = 0.16  # noqa: F841  (the global that broke the notebook's old widget)
    splits.value = 4
    assert text.value != first_text and image.value != first_png and "split 2 reads" in text.value
    tile.value = 32
    splits.value = 2
    assert "split 1 reads blocks" in text.value and "nan" not in text.value.lower()
    data = widget._repr_mimebundle_()
    assert data["text/plain"].startswith("[interactive view:") and "num_splits=2, tile=32" in data["text/plain"]


def test_course_widgets_are_built_by_minikv_viz_never_wired_to_a_notebook_function():
    """A widget wired in a notebook (interact, observe) calls a function that reads the notebook's globals,
    which later cells rebind; every course widget comes from minikv.viz, which takes its data as arguments."""
    import json
    from pathlib import Path

    offenders = []
    for path in sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            src = "".join(cell["source"])
            if cell["cell_type"] == "code" and any(s in src for s in ("interact(", "interactive(", ".observe(")):
                offenders.append(f"{path.name} cell {i}")
    assert not offenders, offenders


def test_trace_records_each_copy_on_write_the_engine_made():
    llm = paged()
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    trace = record_trace(llm, [PROMPTS[0]], params)  # 9 tokens in blocks of 4: a shared partial block
    copies = [(step, src, dst) for step, snap in enumerate(trace.steps) for src, dst in snap.copies]
    assert len(copies) == llm.stats()["cow_copies"] == 2
    for step, src, dst in copies:
        tables = [s.block_table for s in trace.steps[step].seqs.values()]
        holder = next(t for t in tables if dst in t)
        assert src not in holder and any(src in t for t in tables)  # the writer left the shared block to others
        assert f"block {src} -> {dst}" in "\n".join(step_lines(trace, step))


def test_prefix_widget_keeps_one_size_and_pages_a_deep_tree():
    """Notebook 06: the picture never shrinks its text to fit a deep chain, and never changes height."""
    import io

    from PIL import Image

    from minikv.viz.prefix import COLUMNS, prefix_widget, run_and_snap

    snaps = {}
    for design in ("hash", "radix"):
        llm = LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=40, prefix_caching=design)
        one = SamplingParams(max_tokens=1)
        _, a = run_and_snap(llm, "short", list(range(3, 15)), one)
        _, b = run_and_snap(llm, "deep", list(range(3, 15)) + list(range(40, 88)), one)  # 15 blocks deep
        snaps[design] = a + b
    widget = prefix_widget(snaps["hash"], snaps["radix"])
    slider, pages, image, text = widget.children
    assert len(pages.options) == 2 and COLUMNS == 8  # 15 levels, 8 at a time
    sizes, pictures = set(), set()
    for event in range(len(snaps["hash"])):
        slider.value = event
        for page in (0, 1):
            pages.value = page
            sizes.add(Image.open(io.BytesIO(image.value)).size)
            pictures.add(bytes(image.value))
    assert len(sizes) == 1 and len(pictures) > 4, sizes
    assert text.layout.height and text.layout.overflow == "auto"  # the words scroll in a box of fixed height
    assert widget._repr_mimebundle_()["text/plain"].startswith("[interactive view: a slider over 4 events")


def test_ttft_plot_draws_medians_with_their_spread_and_the_work_beneath():
    import matplotlib.pyplot as plt

    from minikv.viz.prefix import plot_ttft

    ax = plot_ttft({"off": [[1.0, 3.0, 2.0], [1.0, 1.2, 9.0]], "hash": [[2.0, 1.0, 1.5], [0.2, 0.3, 0.25]]},
                   {"off": [241, 241], "hash": [241, 17]})
    fig = ax.figure
    assert len(fig.axes) == 2  # time above, tokens computed below
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == [0.25, 1.2, 1.5, 2.0]  # medians, not means (the 9.0 outlier does not move its bar)
    assert sorted(round(p.get_height()) for p in fig.axes[1].patches) == [17, 241, 241, 241]
    plt.close(fig)


# ---- notebooks 01 and 02: what each step computes and reads, naive or cached ----------------------------
@pytest.mark.parametrize("P,N", [(1, 1), (5, 1), (7, 9), (32, 24)])
def test_recompute_counts_equal_the_closed_forms(P, N):
    from minikv.viz.recompute import kv_steps, running_totals

    naive, cached = kv_steps(P, N, cached=False), kv_steps(P, N, cached=True)
    assert [s.rows_computed for s in naive] == [P + t for t in range(N)]
    assert [s.rows_computed for s in cached] == [P] + [1] * (N - 1)  # the prefill, then one row a step
    assert [len(s.read) for s in cached] == [0] + [P + t - 1 for t in range(1, N)]
    assert all(len(s.read) == 0 for s in naive)
    for t in range(N):  # running totals, the sums notebook 01 counts in closed form
        n = running_totals(naive, t, cached=False)
        c = running_totals(cached, t, cached=True)
        assert n.rows_computed == (t + 1) * P + t * (t + 1) // 2
        assert c.rows_computed == P + t
        assert n.scores == sum((P + s) ** 2 for s in range(t + 1))
        assert c.scores == P * P + sum(P + s for s in range(1, t + 1))
        assert (n.rows_held, c.rows_held) == (0, P + t)


def test_recompute_grid_marks_what_each_step_computes_and_reads():
    from minikv.viz.recompute import COMPUTED, NOT_YET, READ, kv_grid

    P, N = 6, 5
    naive, cached = kv_grid(P, N, False, upto=N - 1), kv_grid(P, N, True, upto=N - 1)
    assert naive.shape == cached.shape == (N, P + N - 1)
    assert ((naive == COMPUTED).sum(axis=1) == [P + t for t in range(N)]).all() and not (naive == READ).any()
    assert ((cached == COMPUTED).sum(axis=1) == [P, 1, 1, 1, 1]).all()
    assert [int(row.argmax()) for row in (cached[1:] == COMPUTED)] == [P, P + 1, P + 2, P + 3]  # the newest position
    assert ((cached == READ).sum(axis=1) == [0, P, P + 1, P + 2, P + 3]).all()
    assert (kv_grid(P, N, True, upto=2)[3:] == NOT_YET).all()  # later steps not drawn yet
    with pytest.raises(ValueError, match="at least 1 new token"):
        kv_grid(P, 0, True, upto=0)


def test_recompute_bytes_come_from_the_engines_model_and_cache():
    from minikv.model.shapes import format_bytes
    from minikv.viz.recompute import KVRowShape, recompute_lines

    llm = LLM("tiny-random", kv_backend="contiguous", max_num_seqs=2, max_model_len=64)
    shape = KVRowShape.from_llm(llm)
    c, pool = llm.config, llm.backend.pool
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (c.num_layers, c.num_kv_heads, c.head_dim)
    assert shape.bytes_per_row == c.kv_bytes_per_token  # fp32 on this machine
    assert shape.bytes_per_row * pool.k_cache.shape[1] * pool.max_len == pool.bytes_reserved  # the row pool's own size
    text = "\n".join(recompute_lines(shape, 10, 4, step=3, cached=True))
    assert f"cache held after this step: 13 rows = {format_bytes(13 * c.kv_bytes_per_token)}" in text
    assert f"2 x {c.num_layers} layers x {c.num_kv_heads} kv heads x {c.head_dim} x 4 B" in text
    assert "cache held after this step: 0 B" in "\n".join(recompute_lines(shape, 10, 4, step=3, cached=False))


def test_recompute_widget_moves_with_its_controls_and_reads_no_caller_variable():
    from minikv.viz.recompute import recompute_widget

    llm = LLM("tiny-random", kv_backend="naive")
    prompt = [(7 * j) % 200 + 3 for j in range(12)]
    answer = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    widget = recompute_widget(llm, prompt, answer)
    controls, image, text = widget.children
    slider, mode = controls.children
    assert slider.value == 5 and "step 5 of 6" in text.value  # opens at the last step: the whole run
    slider.value = 0
    first_text, first_png = text.value, image.value
    assert "step 0 of 6" in first_text and "12 rows again" in first_text
    prompt.clear()  # the caller's lists change, or their names are rebound: the view keeps its copies
    answer[:] = [0]
    llm = None  # noqa: F841
    slider.value = 4
    assert "step 4 of 6" in text.value and "16 rows again" in text.value and image.value != first_png
    assert "K/V rows computed, steps 0..4: 70" in text.value  # 12 + 13 + 14 + 15 + 16
    naive_png = image.value
    mode.value = True
    assert "reads [0, 15) = 15 rows from the cache" in text.value and image.value != naive_png
    assert "K/V rows computed, steps 0..4: 16" in text.value
    data = widget._repr_mimebundle_()
    assert data["text/plain"].startswith("[interactive view:") and "step 4 of 6 (decode)" in data["text/plain"]
    assert data["image/png"]
    with pytest.raises(ValueError, match="outside this generation's steps 0..5"):
        recompute_widget(LLM("tiny-random", kv_backend="naive"), [3, 4], [5] * 6, step=6)
