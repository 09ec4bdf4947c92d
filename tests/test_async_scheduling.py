"""Async scheduling (minikv/engine/overlap.py): the host prepares step t+1 before step t's tokens are read.

On a CPU the overlap is only logical (one device), but the engine runs the same code path when it is
forced on: placeholders, fed input ids, wasted rows, deferred block frees. Everything here compares an
engine with async_scheduling=True against the same engine with it off: outputs, streamed events and
the pool must be identical, and the overlapped path must really have run (overlapped_steps > 0).
"""
from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv import LLM, SamplingParams
from minikv.engine.overlap import PLACEHOLDER

PROMPTS = [[(7 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 11, 3, 8, 14, 6))]


def tiny(async_scheduling: bool, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 64, **kw}
    return LLM("tiny-random", kv_backend="paged", async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    off = tiny(False)
    return off, off.derive(async_scheduling=True)


def assert_clean(llm: LLM) -> None:
    """Drained: nothing in flight, every block free, refcounts agree with the (empty) block tables."""
    assert not llm.has_unfinished()
    bm, sch = llm.block_manager, llm.scheduler
    bm.check(sch.all_sequences())
    assert not sch.finishing and bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} blocks leaked"


def event_key(e) -> tuple:
    """A StreamEvent without its request id (each engine numbers its requests)."""
    return e.index, e.sample_index, e.token_id, e.text_delta, e.finished, e.finish_reason


def outputs(llm: LLM, prompts, params) -> list:
    return [(o.token_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)]


def mixed_params(max_tokens=(4, 9, 1, 12, 6, 7)) -> list[SamplingParams]:
    """Greedy, seeded temperature, top-p and top-k rows in one batch; one request of a single token."""
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=0.6, top_p=0.9, seed=12),
             dict(temperature=1.0, top_k=5, seed=13), dict(), dict(temperature=0.7, top_p=0.95, seed=14)]
    return [SamplingParams(max_tokens=m, ignore_eos=True, **k) for m, k in zip(max_tokens, kinds)]


def test_the_default_is_off_on_a_cpu_on_for_a_paged_gpu_engine_and_stats_say_which():
    assert LLM("tiny-random", device="cpu", kv_backend="paged").stats()["config"]["async_scheduling"] is False
    assert tiny(True).stats()["config"]["async_scheduling"] is True
    if torch.cuda.is_available():
        assert LLM("tiny-random", device="cuda", kv_backend="paged", num_blocks=64).async_scheduling is True
    with pytest.raises(ValueError, match="kv_backend='paged' or async_scheduling=False"):
        LLM("tiny-random", kv_backend="contiguous", async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        LLM("tiny-random", kv_backend="paged", async_scheduling="yes")


def test_switching_it_mid_run_finishes_the_step_in_flight_first(pair):
    off, _ = pair
    llm = tiny(True)
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, mixed_params())]
    for i in range(8):
        llm.step()
        if i in (2, 5):
            llm.async_scheduling = not llm.async_scheduling
            assert llm.core._inflight is None and llm.stats()["config"]["async_scheduling"] is (i == 5)
    while llm.has_unfinished():
        llm.step()
    assert [s.output_token_ids for s in seqs] == [t for t, _, _ in outputs(off, PROMPTS, mixed_params())]
    assert_clean(llm)
    with pytest.raises(ValueError, match="must be True or False"):
        llm.async_scheduling = None


def test_same_tokens_greedy_and_seeded_sampling_and_every_block_back(pair):
    off, on = pair
    want = outputs(off, PROMPTS, mixed_params())
    before = on.num_overlapped_steps
    assert outputs(on, PROMPTS, mixed_params()) == want
    assert on.num_overlapped_steps - before >= 8, "the overlapped path did not run"
    assert [len(t) for t, _, _ in want] == [4, 9, 1, 12, 6, 7]
    assert_clean(on)


def test_the_engine_counts_its_waits_for_the_device_inside_its_steps(pair, monkeypatch):
    """wait_seconds: the part of step_seconds an overlapped step spent waiting for the device's sampled ids
    (a CPU has no device to wait for: the wait here stands in for one, 2 ms a step at least)."""
    from minikv.engine.overlap import InFlight

    _, on = pair
    waits = []
    real = InFlight.wait

    def device_time(self):
        waits.append(1)
        time.sleep(0.002)
        real(self)
    monkeypatch.setattr(InFlight, "wait", device_time)
    steps, inside, waited = on.core.num_steps, on.core.step_seconds, on.core.wait_seconds
    outputs(on, PROMPTS, mixed_params())
    overlapped_waits = on.core.wait_seconds - waited
    assert overlapped_waits >= 0.002 * 8, "fewer waits counted than the overlapped steps made"
    assert overlapped_waits <= on.core.step_seconds - inside, "waits are part of the time inside steps"
    assert on.core.num_steps > steps and len(waits) >= 8
    snap = on.view.snapshot()
    assert snap.wait_seconds == on.core.wait_seconds and snap.step_seconds == on.core.step_seconds


def test_steady_steps_keep_one_draw_plan_and_draw_what_a_fresh_plan_draws(pair, monkeypatch):
    """The overlapped step keeps its sampling rows' DrawPlan while they are the same sequences in order: a
    run of decode steps makes few plans, and every step's packed rows equal those of a plan made afresh."""
    from minikv.engine.sampler import DrawPlan

    off, on = pair
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, top_p=0.9, seed=20 + i) for i in range(4)]
    want = outputs(off, PROMPTS[:4], params)  # (the plain step makes a plan each step: not counted)
    made, steps = [], []
    real = DrawPlan.__init__

    def counted(self, params):
        made.append(1)
        real(self, params)
    monkeypatch.setattr(DrawPlan, "__init__", counted)
    draws = on.core._draws

    def checked(seqs):
        plan, keys = draws(seqs)
        fresh = object.__new__(DrawPlan)
        real(fresh, [s.params for s in seqs])
        assert torch.equal(plan.packed(keys), fresh.packed(keys)), "a kept plan drew other rows than a fresh one"
        steps.append(len(seqs))
        return plan, keys
    monkeypatch.setattr(on.core, "_draws", checked)
    assert outputs(on, PROMPTS[:4], params) == want
    assert len(steps) >= 12 and len(made) <= len(steps) // 3, (len(made), len(steps))
    assert on.core._drawn is None, "a finished batch's sequences are still held by the kept plan"
    seqs = [on.add_request(p, q) for p, q in zip(PROMPTS[:4], params)]
    on.step()
    on.step()
    assert on.core._drawn is not None and on.core._drawn[1] == seqs
    on.abort(seqs[0])
    assert on.core._drawn is None, "an abort lets go of the kept plan"
    for s in seqs[1:]:
        on.abort(s)
    while on.has_unfinished():
        on.step()
    assert on.core._drawn is None
    assert_clean(on)


def test_a_running_request_keeps_the_params_it_was_added_with(pair):
    """The engine takes a copy of a request's SamplingParams: changing the caller's object afterwards (here
    shared by every request, as generate() shares one) changes no running request."""
    off, on = pair
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=5)
    want = [(o.token_ids, o.finish_reason) for o in off.generate(PROMPTS[:3], params)]
    seqs = [on.add_request(p, params) for p in PROMPTS[:3]]
    on.step()
    on.step()
    params.temperature, params.max_tokens, params.seed = 0.0, 2, 6
    while on.has_unfinished():
        on.step()
    assert [(s.output_token_ids, s.finish_reason) for s in seqs] == want
    assert all(s.params is not params for s in seqs)
    assert_clean(on)


def test_eos_ends_a_request_at_the_same_token(pair):
    off, on = pair
    greedy = off.generate(PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    for llm in pair:
        llm.eos_token_ids = {greedy[3]}
    try:
        params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, ignore_eos=True)]
        want = outputs(off, [PROMPTS[1], PROMPTS[0]], params)
        assert outputs(on, [PROMPTS[1], PROMPTS[0]], params) == want
    finally:
        for llm in pair:
            llm.eos_token_ids = {2}
    assert want[0][0] == greedy[:4] and want[0][2] == "stop"
    assert_clean(on)


def test_streamed_events_come_in_the_same_order(pair):
    off, on = pair
    params = mixed_params()
    want = [event_key(e) for e in off.stream(PROMPTS, params)]
    assert [event_key(e) for e in on.stream(PROMPTS, params)] == want
    assert_clean(on)


def test_chunked_prefill_beside_decodes_overlaps_and_matches():
    """A prompt longer than the token budget runs in chunks (steps that sample nothing for it) while
    others decode; the chunks' steps overlap too."""
    off, on = tiny(False, max_num_batched_tokens=8), tiny(True, max_num_batched_tokens=8)
    prompts = [[5 + i % 200 for i in range(41)], PROMPTS[0], PROMPTS[2]]  # the long one first: 5 chunk-only steps
    params = [SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)]
    want = outputs(off, prompts, params)
    log = BatchLog()
    on.add_observer(log)
    assert outputs(on, prompts, params) == want
    assert any(len(batch) == 1 and batch[0].num_prompt_tokens == 41 for batch in log.batches), "no chunk-only step"
    assert on.num_overlapped_steps >= len(log.batches) - 3
    assert_clean(on)


@pytest.mark.slow  # the Triton backend's decode steps in the interpreter on the CPU
def test_decode_steps_through_the_graphs_static_buffers_get_their_fed_ids():
    """The graph path copies input ids into static buffers: the fed ids must be in place before."""
    from minikv.engine.cuda_graph import DecodeGraphs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype=torch.float32, attention="triton", cuda_graphs=False, max_model_len=96)
    off, on = tiny(False, **kw), tiny(True, **kw)
    for llm in (off, on):
        llm.runner.decode_graphs = DecodeGraphs(llm.model, llm.backend, llm.device, llm.block_size,
                                                llm.scheduler.max_num_seqs, llm.max_model_len,
                                                llm.config.vocab_size, capture=device == "cuda")
    want = outputs(off, PROMPTS, mixed_params())
    assert outputs(on, PROMPTS, mixed_params()) == want
    assert on.num_overlapped_steps > 5
    assert_clean(on)


class BatchLog:
    """An observer: the sequences of every scheduled batch, and each request's events as published."""

    def __init__(self):
        self.batches: list[list] = []
        self.events: list = []

    def on_schedule(self, llm, batch) -> None:
        self.batches.append(list(batch.seqs))

    def on_step(self, llm, batch, events) -> None:
        self.events += [(seq, tok) for seq, tok, _ in events]


def test_a_finished_sequences_wasted_row_never_reaches_its_output_and_its_blocks_wait_for_the_step():
    llm = tiny(True)
    log = BatchLog()
    llm.add_observer(log)
    short = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    long = llm.add_request(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.step()  # prefill: both sample their first token; step 2 is already on the device
    llm.step()  # short samples its 2nd token and finishes, but it runs in step 3 too: a wasted row
    assert short.is_finished and len(short.output_token_ids) == 2
    assert any(s is short for s in log.batches[2]), "short was not scheduled in step 3: no wasted row to check"
    held = list(short.block_table)
    assert held and short in llm.scheduler.finishing, "blocks of a finished sequence in flight went back early"
    assert all(llm.block_manager.ref_count[b] > 0 for b in held)
    llm.step()  # step 3 read back: short's row is dropped, its blocks go back now
    assert short.block_table == [] and short not in llm.scheduler.finishing
    while llm.has_unfinished():
        llm.step()
    assert len(short.output_token_ids) == 2 and PLACEHOLDER not in short.output_token_ids + long.output_token_ids
    assert [tok for seq, tok in log.events if seq is short] == short.output_token_ids
    assert len(long.output_token_ids) == 6
    want = tiny(False).generate([PROMPTS[0], PROMPTS[1]], [short.params, long.params])
    assert [short.output_token_ids, long.output_token_ids] == [o.token_ids for o in want]
    assert_clean(llm)


def test_requests_arriving_while_others_decode_and_an_abort(pair):
    off, on = pair
    results = []
    for llm in pair:
        a = llm.add_request(PROMPTS[4], SamplingParams(max_tokens=12, ignore_eos=True))
        b = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=9, temperature=0.9, seed=5, ignore_eos=True))
        for _ in range(3):
            llm.step()
        c = llm.add_request(PROMPTS[3], SamplingParams(max_tokens=5, top_p=0.8, temperature=0.7, seed=6,
                                                       ignore_eos=True))
        llm.step()
        llm.step()
        llm.abort(b)
        assert b.finish_reason == "abort"
        d = llm.add_request(PROMPTS[5], SamplingParams(max_tokens=1, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        results.append([(s.output_token_ids, s.finish_reason) for s in (a, b, c, d)])
        assert_clean(llm)
    assert results[0] == results[1]
    assert len(results[1][1][0]) == 5  # b had sampled 5 tokens when it was aborted, in both modes


def test_an_observer_that_aborts_a_request_mid_step_leaves_the_engine_sound():
    """on_schedule of step t+1 runs while step t's tokens are placeholders: an abort there drops the
    placeholder; the others run on unchanged."""
    want = outputs(tiny(False), PROMPTS[:3], mixed_params()[:3])
    llm = tiny(True)
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:3], mixed_params()[:3])]

    class AbortAtThirdSchedule:
        calls = 0

        def on_schedule(self, engine, batch) -> None:
            self.calls += 1
            if self.calls == 3:
                engine.abort(seqs[1])
            if self.calls == 5:  # every request at once: the step in flight computes nothing wanted
                for seq in seqs:
                    engine.abort(seq)

    llm.add_observer(AbortAtThirdSchedule())
    while llm.has_unfinished():
        llm.step()
    for seq, (tokens, _, _) in zip(seqs, want):
        assert PLACEHOLDER not in seq.output_token_ids and seq.output_token_ids == tokens[:len(seq.output_token_ids)]
    assert seqs[1].finish_reason == "abort" and len(seqs[1].output_token_ids) < len(want[1][0])
    assert_clean(llm)


def test_an_abort_of_a_stream_mid_run_returns_every_block(pair):
    off, on = pair
    got = []
    for llm in pair:
        tokens = []
        for event in llm.stream(PROMPTS[:3], SamplingParams(max_tokens=20, ignore_eos=True)):
            tokens.append(event.token_id)
            if len(tokens) == 7:
                break  # the consumer stops: every request of the stream is aborted
        got.append(tokens)
        assert_clean(llm)
    assert got[0] == got[1]


@pytest.mark.parametrize("case", ["preemption", "n>1", "beams", "prefix cache", "radix cache"])
def test_fallbacks_give_the_same_tokens(case):
    kw = {"preemption": dict(num_blocks=14, max_num_seqs=6, max_num_batched_tokens=16),
          "prefix cache": dict(prefix_caching="hash"), "radix cache": dict(prefix_caching="radix")}.get(case, {})
    off, on = tiny(False, **kw), tiny(True, **kw)
    if case == "beams":
        want = [c.token_ids for c in off.beam_search(PROMPTS[1], beam_width=3, max_tokens=6)[0].outputs]
        assert [c.token_ids for c in on.beam_search(PROMPTS[1], beam_width=3, max_tokens=6)[0].outputs] == want
    else:
        n = 2 if case == "n>1" else 1
        params = [SamplingParams(max_tokens=8, n=n, temperature=1.0, seed=20 + i, ignore_eos=True) for i in range(4)]
        prompts = [PROMPTS[4][:8] + p for p in PROMPTS[:4]] if "prefix_caching" in kw else PROMPTS[:4]
        want = [[c.token_ids for c in o.outputs] for o in off.generate(prompts, params)]
        assert [[c.token_ids for c in o.outputs] for o in on.generate(prompts, params)] == want
        if case == "preemption":
            assert on.scheduler.num_preemptions > 0
        if case != "preemption":
            assert on.num_overlapped_steps > 0
    assert_clean(on)


def test_a_fault_inside_an_overlapped_step_leaves_the_engine_sound():
    want = outputs(tiny(False), PROMPTS, mixed_params())
    for fire_at in (2, 3, 5, 8):
        llm = tiny(True)
        calls = {"n": 0}
        forward = llm.runner.forward

        def faulty(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == fire_at:
                raise KeyboardInterrupt("stop pressed")
            return forward(*args, **kwargs)

        llm.runner.forward = faulty
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, mixed_params())
        assert_clean(llm)
        llm.runner.forward = forward
        assert outputs(llm, PROMPTS, mixed_params()) == want


def test_a_request_whose_sampling_fails_ends_alone_in_an_overlapped_step(monkeypatch):
    import minikv.engine.core as llm_module

    def failing(real):
        def sample(logits, params, keys):  # a request with top_k=7 cannot be sampled (a stand-in fault)
            if any(p.top_k == 7 for p in params):
                raise FloatingPointError("probabilities are nan")
            return real(logits, params, keys)
        return sample

    for name in ("sample", "sample_on_device"):
        monkeypatch.setattr(llm_module, name, failing(getattr(llm_module, name)))
    bad = SamplingParams(max_tokens=5, top_k=7, temperature=1.0)
    good = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=4, temperature=0.8, seed=2,
                                                                          ignore_eos=True)]
    got = []
    for on in (False, True):
        llm = tiny(on)
        first = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], good)]
        llm.step()
        llm.step()
        events = [event_key(e) for e in llm.stream([PROMPTS[2], PROMPTS[3]], [bad, good[0]])]  # joins the decodes
        while llm.has_unfinished():
            llm.step()
        assert [e for e in events if e[0] == 0] == [(0, 0, None, "", True, "error")]  # one event: the failure
        got.append(([s.output_token_ids for s in first], events))
        assert_clean(llm)
    assert got[0] == got[1]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_fault_at_any_call_of_an_overlapped_engine_leaves_it_sound(preemption):
    """test_faults.py's injector (a KeyboardInterrupt at call N into the runner, the block manager, its
    allocator, the swap space or the prefix cache) on an engine that overlaps its steps."""
    import random

    from test_faults import Injector, workload

    def engine() -> LLM:  # test_faults.py's engine, overlapped: the pool forces preemptions
        return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=14, max_num_seqs=6,
                   max_num_batched_tokens=16, preemption=preemption, prefix_caching="hash", async_scheduling=True)

    fresh = workload(engine())
    llm = engine()
    counter = Injector(llm, fire_at=None)
    assert workload(llm) == fresh
    counter.remove()
    points = sorted({1, 2, counter.calls} | set(random.Random(5).sample(range(3, counter.calls), 10)))
    for fire_at in points:
        injector = Injector(llm, fire_at)
        try:
            assert workload(llm) == fresh
        except KeyboardInterrupt:
            pass
        injector.remove()
        assert_clean(llm)
        assert workload(llm) == fresh, f"fault at call {fire_at}: the next run differs from a fresh engine's"


@pytest.mark.slow
def test_smollm2_text_stop_strings_and_sampling_match():
    off = LLM("smollm2-135m", kv_backend="paged", async_scheduling=False, max_num_seqs=8)
    on = off.derive(async_scheduling=True)
    prompts = [off.chat_prompt("Count from 1 to 10, separated by commas."), "The capital of France is",
               "def fibonacci(n):", "Once upon a time"]
    params = [SamplingParams(max_tokens=24, stop=["5"]), SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9,
                                                                         seed=1),
              SamplingParams(max_tokens=1), SamplingParams(max_tokens=20, temperature=1.0, seed=2)]
    want = outputs(off, prompts, params)
    assert want[0][2] == "stop" and "5" not in want[0][1] and len(want[2][0]) == 1
    assert outputs(on, prompts, params) == want
    assert [event_key(e) for e in on.stream(prompts, params)] == [event_key(e) for e in off.stream(prompts, params)]
    assert on.num_overlapped_steps > 0
    assert_clean(on)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 9), st.sampled_from([0.0, 0.8]),
              st.sampled_from([1.0, 0.9]), st.one_of(st.none(), st.integers(1, 8))),
    st.tuples(st.just("step"), st.integers(1, 3)),
), min_size=1, max_size=14)


def run_trace(llm: LLM, ops) -> list:
    """Play a trace of arrivals and steps; every request's tokens and finish reason.

    A request added between steps starts one step later with the overlap (the step after the call
    was already launched), so an abort is tied to the request's progress, not to a step count: a
    request added with abort_at=k is aborted right after the step that gives it its k-th token."""
    seqs, aborts = [], []

    def step():
        llm.step()
        for seq, k in aborts:
            if not seq.is_finished and len(seq.output_token_ids) >= k:
                llm.abort(seq)
        llm.block_manager.check(llm.scheduler.all_sequences())

    for op in ops:
        if op[0] == "add":
            _, p, max_tokens, temperature, top_p, abort_at = op
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=len(seqs),
                                    ignore_eos=True)
            seqs.append(llm.add_request(PROMPTS[p], params))
            if abort_at is not None:
                aborts.append((seqs[-1], abort_at))
        else:
            for _ in range(op[1]):
                if llm.has_unfinished():
                    step()
    while llm.has_unfinished():
        step()
    return [(s.output_token_ids, s.finish_reason) for s in seqs]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, small_pool=st.booleans())
def test_random_arrivals_and_aborts_give_the_same_outputs_and_a_clean_pool(ops, small_pool):
    kw = dict(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=16) if small_pool else {}
    off, on = tiny(False, **kw), tiny(True, **kw)
    got = run_trace(on, ops)
    assert got == run_trace(off, ops)
    assert_clean(on)
