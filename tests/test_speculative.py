"""Rung 11: speculative decoding. Greedy output equals rung 7's token for token; sampled output keeps the
target's distribution; after every step the pool holds exactly the blocks the accepted tokens need."""
import math
import random

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.attention import AttentionMetadata, NaiveBackend
from minikv.cache.block_manager import blocks_needed
from minikv.engine.speculative import accept_greedy, accept_sampled, propose_ngram, rollback_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(kv_backend="paged", block_size=4, num_blocks=64)
REPEATS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", **TINY)


def chi2_bound(dof: int, z: float = 3.09) -> float:
    """The chi-square value a correct sampler exceeds once in 1,000 runs (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class RollbackInvariant:
    """After every step: each running request holds exactly ceil(num_computed_tokens / block_size)
    blocks, and the pool's used blocks are exactly those in the block tables (prefix caching off)."""

    def __init__(self):
        self.steps = 0

    def on_step(self, llm, batch, events):
        bm, running = llm.block_manager, llm.scheduler.running
        for s in running:
            assert len(s.block_table) == blocks_needed(s.num_computed_tokens, bm.block_size), s
            assert s.num_computed_tokens == s.num_tokens - 1 or s.num_computed_tokens < s.num_prompt_tokens, s
        if llm.prefix_cache is None:
            assert bm.num_used_blocks == len({b for s in running for b in s.block_table})
        bm.check(llm.scheduler.all_sequences())
        self.steps += 1


class NoDraftsWhenPreempting:
    """A step that preempts a request runs no draft token: drafts shrink (to none) first."""

    def on_schedule(self, llm, batch):
        if batch.preempted:
            drafts = llm.core.speculator.num_drafts
            assert all(n <= s.num_tokens - start - drafts(s)
                       for s, start, n in zip(batch.seqs, batch.starts, batch.num_new_tokens)), batch


# ---- proposals and acceptance, alone -----------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_recent_match():
    assert propose_ngram([1, 2, 3, 4, 5, 2, 3, 4], 3) == [5, 2, 3]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # the most recent "1 2"
    assert propose_ngram([1, 2, 3], 4) == []  # nothing repeats


def test_greedy_acceptance_keeps_the_matching_prefix_then_the_targets_token():
    assert accept_greedy([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accept_greedy([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]  # all kept, plus the bonus token
    assert accept_greedy([4, 5, 6], [7, 5, 6, 1]) == [7]


@pytest.mark.parametrize("point_mass", [True, False])
def test_rejection_rule_gives_the_targets_distribution_with_a_draft_that_disagrees(point_mass):
    V, trials = 6, 5_000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    q = torch.softmax(3 * torch.randn(1, V, generator=g), dim=-1)  # peaked elsewhere: rejects often
    rng = random.Random(1)
    counts = [0] * V
    for _ in range(trials):
        d = max(range(V), key=lambda i: q[0, i]) if point_mass else rng.choices(range(V), weights=q[0].tolist())[0]

        def draw(dist, j):
            return rng.choices(range(V), weights=dist.tolist())[0]
        kept = accept_sampled([d], p, [rng.random()], draw, None if point_mass else q)
        counts[kept[0]] += 1
    expected = [trials * float(x) for x in p[0]]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert chi2 < chi2_bound(V - 1), (counts, expected)


def test_rollback_gives_back_the_blocks_past_the_accepted_tokens_last_first():
    table, freed = [7, 3, 9, 12], []
    rollback_blocks(table, 6, 4, freed.append)
    assert (table, freed) == ([7, 3], [12, 9])


# ---- the engine -------------------------------------------------------------------------------------
def test_greedy_ngram_speculation_equals_rung_7_on_smollm2(smollm2_dir):
    base = LLM(str(smollm2_dir), kv_backend="paged", dtype="float32", num_blocks=64)
    prompts = [base.chat_prompt("Repeat exactly: red green blue, red green blue, red green blue.")]
    params = SamplingParams(max_tokens=10, temperature=0)
    want = [o.token_ids for o in base.generate(prompts, params)]
    spec = LLM(base.loaded, kv_backend="paged", dtype="float32", num_blocks=64, speculative="ngram",
               num_speculative_tokens=4)
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    stats = spec.stats()["speculative"]
    assert stats["ngram"]["accepted"] > 0 and sum(o.num_accepted_tokens for o in outs) == stats["accepted"]
    assert stats["drafted"] >= stats["accepted"] and 0 < stats["acceptance_rate"] <= 1


CASES = {
    "prefix caching": dict(prefix_caching="hash"),
    "preemption by recompute": dict(num_blocks=14),
    "preemption by swap": dict(num_blocks=14, preemption="swap"),
    "chunked prefill": dict(max_num_batched_tokens=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_speculation_equals_rung_7(case, tiny):
    """With drafts the target always accepts (the target as its own draft) and drafts it mostly rejects
    (its first layer alone)."""
    opts = {**TINY, **CASES[case]}
    base = LLM(tiny.loaded, **opts)
    prompts = REPEATS + [REPEATS[0][:6] + [40, 41]]  # the last shares a cached prefix with the first
    want = [o.token_ids for o in base.generate(prompts, GREEDY)]
    for draft in (tiny.loaded, "self:1"):
        spec = LLM(tiny.loaded, speculative="draft", draft_model=draft, num_speculative_tokens=3, **opts)
        spec.add_observer(RollbackInvariant())
        spec.add_observer(NoDraftsWhenPreempting())
        for _ in range(2 if "prefix_caching" in opts else 1):  # the second time on cached blocks
            assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == want, (case, draft)
        if "num_blocks" in CASES[case]:
            assert spec.stats()["num_preemptions"] > 0
        assert spec.stats()["used_blocks"] == (0 if "prefix_caching" not in opts else spec.stats()["used_blocks"])
    assert spec.stats()["speculative"]["drafted"] > 0


def test_target_as_its_own_draft_accepts_everything_and_takes_fewer_steps(tiny):
    steps = {}
    for name, opts in (("plain", {}), ("spec", dict(speculative="draft", draft_model=tiny.loaded))):
        llm = LLM(tiny.loaded, **TINY, **opts)
        inv = RollbackInvariant()
        llm.add_observer(inv)
        out = llm.generate([REPEATS[0]], GREEDY)[0]
        steps[name] = inv.steps
    assert out.num_accepted_tokens == out.num_drafted_tokens > 0
    assert steps["spec"] * 3 < steps["plain"]  # k = 4: up to 5 tokens a step


class AlwaysWrong:
    """Drafts the target never keeps: each one differs from the token greedy decoding gives there."""

    method = "ngram"

    def __init__(self, want: list[int], prompt_len: int):
        self.want, self.prompt_len = want, prompt_len

    def propose(self, seqs, ks):
        return [[(self.want[s.num_tokens - self.prompt_len + j] + 1) % 512 for j in range(k)]
                for s, k in zip(seqs, ks)]

    def rollback(self, seq, num_accepted):
        pass

    def sweep(self):
        pass

    def reset(self):
        pass


def test_a_request_rejecting_every_draft_for_100_steps_holds_the_blocks_of_one_that_never_speculated(tiny):
    params = SamplingParams(max_tokens=101, temperature=0, ignore_eos=True)
    prompt = REPEATS[1]
    tables, want = {}, None
    for name, opts in (("plain", {}), ("spec", dict(speculative="ngram"))):
        llm = LLM(tiny.loaded, **{**TINY, "num_blocks": 40}, **opts)
        seen = []

        class Record:
            def on_step(self, llm, batch, events):
                s = batch.seqs[0]
                seen.append((s.num_tokens, len(s.block_table), llm.block_manager.num_used_blocks))
        llm.add_observer(Record())
        if name == "spec":
            llm.add_observer(RollbackInvariant())
            llm.core.speculator.proposer = AlwaysWrong(want, len(prompt))
        out = llm.generate([prompt], params)[0]
        if name == "plain":
            want = out.token_ids
        tables[name] = seen
        assert out.token_ids == want
    assert tables["spec"] == tables["plain"]  # same blocks held at every step, 100 steps of rejections
    assert out.num_drafted_tokens > 300 and out.num_accepted_tokens == 0


def test_sampled_speculation_keeps_the_targets_distribution_and_seeds_repeat(tiny):
    """The first token a request verifies (its second), over many seeds, against softmax(logits / T)
    restricted to the top 4, with a draft (the target's first layer) that mostly proposes other tokens."""
    spec = LLM(tiny.loaded, kv_backend="paged", block_size=4, num_blocks=1200, max_num_seqs=400,
               max_num_batched_tokens=4096, speculative="draft", draft_model="self:1", num_speculative_tokens=2)
    prompt, n = [9, 8, 7, 6, 5], 1200
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i, ignore_eos=True) for i in range(n)]
    outs = spec.generate([prompt] * n, params)
    stats = spec.stats()["speculative"]
    assert stats["drafted"] >= n and stats["accepted"] < stats["drafted"] / 2  # it disagrees often
    by_first: dict[int, list[int]] = {}
    for o in outs:
        by_first.setdefault(o.token_ids[0], []).append(o.token_ids[1])
    chi2, dof = 0.0, 0
    model = tiny.loaded.model
    at = next(model.parameters()).device  # the reference forward runs where the engine's weights are
    for first, seconds in by_first.items():
        ids = torch.tensor(prompt + [first], device=at)
        with torch.inference_mode():
            logits = model(ids, torch.arange(len(ids), device=at),
                           AttentionMetadata.build([len(ids)], [len(ids)], device=at), NaiveBackend()).cpu()
        top = torch.topk(logits[-1], 4)
        p = torch.softmax(top.values, dim=-1)
        expected = {int(t): len(seconds) * float(x) for t, x in zip(top.indices, p)}
        assert set(seconds) <= set(expected), "a token outside the top 4"
        chi2 += sum((seconds.count(t) - e) ** 2 / e for t, e in expected.items())
        dof += 3
    assert chi2 < chi2_bound(dof), (chi2, dof)
    again = spec.generate([prompt] * 20, params[:20])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:20]]


@pytest.mark.parametrize("options, message", [
    (dict(speculative="medusa"), "speculative must be None or one of ngram, draft"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(num_speculative_tokens=4), "give speculative='ngram' or 'draft' too"),
    (dict(speculative="draft"), "needs draft_model"),
    (dict(speculative="draft", draft_model="self:2"), r"use 'self:N' with 1 <= N < 2"),
    (dict(speculative="draft", draft_model="self:x"), "write 'self:N'"),
    (dict(speculative="ngram", draft_model="self:1"), "is for speculative='draft'"),
    (dict(speculative="ngram", async_scheduling=True), "use async_scheduling=False"),
    (dict(speculative="ngram", sliding_window=8), "sliding window"),
    (dict(speculative="ngram", kv_backend="contiguous"), "use kv_backend='paged'"),
])
def test_bad_speculative_options_are_refused_with_the_fix(options, message, tiny):
    with pytest.raises(ValueError, match=message):
        LLM(tiny.loaded, **{**TINY, **options})


def test_overlapped_steps_cannot_be_switched_on_under_speculation(tiny):
    spec = LLM(tiny.loaded, **TINY, speculative="ngram")
    with pytest.raises(ValueError, match="build an engine without speculative to overlap steps"):
        spec.async_scheduling = True


def test_a_speculating_request_aborted_between_steps_keeps_no_draft_and_no_block(tiny):
    spec = LLM(tiny.loaded, **TINY, speculative="draft", draft_model=tiny.loaded)
    want = LLM(tiny.loaded, **TINY).generate([REPEATS[0]], GREEDY)[0].token_ids

    class AbortAfterAVerification:
        def on_step(self, llm, batch, events):
            if llm.stats()["speculative"]["accepted"]:
                llm.abort(batch.seqs[0])
    spec.add_observer(AbortAfterAVerification())
    out = spec.generate([REPEATS[0]], GREEDY)[0]
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < len(want)
    assert out.token_ids == want[:len(out.token_ids)]
    assert spec.stats()["used_blocks"] == 0


def test_a_wrong_rollback_seam_is_caught_and_named(tiny):
    def keeps_everything(block_table, num_computed_tokens, block_size, free):
        pass
    llm = LLM(tiny.loaded, **TINY, speculative="draft", draft_model="self:1", spec_rollback=keeps_everything)
    with pytest.raises(ValueError, match="keeps_everything: request .* must keep"):
        llm.generate([REPEATS[0]], GREEDY)


def test_parallel_samples_and_beams_run_without_drafts(tiny):
    spec = LLM(tiny.loaded, **TINY, speculative="draft", draft_model=tiny.loaded)
    base = LLM(tiny.loaded, **TINY)
    params = SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    assert [c.token_ids for c in spec.generate([REPEATS[0]], params)[0].outputs] == \
        [c.token_ids for c in base.generate([REPEATS[0]], params)[0].outputs]
    assert spec.beam_search([REPEATS[0]], beam_width=2, max_tokens=6)[0].token_ids == \
        base.beam_search([REPEATS[0]], beam_width=2, max_tokens=6)[0].token_ids
    assert spec.stats()["speculative"]["drafted"] == 0


def test_verification_runs_through_the_triton_kernels(tiny):
    """k + 1 query tokens per request go through the Triton paged kernels (the interpreter on a CPU),
    mixed with a prefill in the same step, and give the torch reference's tokens."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    dtype = next(tiny.loaded.model.parameters()).dtype  # float32 on a CPU; the weights' own on a GPU
    opts = dict(kv_backend="paged", block_size=8, num_blocks=16, dtype=dtype)
    want = [o.token_ids for o in LLM(tiny.loaded, **opts).generate(REPEATS[:2], params)]
    spec = LLM(tiny.loaded, **opts, attention="triton", speculative="draft", draft_model=tiny.loaded,
               num_speculative_tokens=2)
    spec.add_observer(RollbackInvariant())
    assert [o.token_ids for o in spec.generate(REPEATS[:2], params)] == want
    assert spec.stats()["speculative"]["accepted"] > 0


def test_minikv_serve_passes_speculation_to_the_engine(monkeypatch, capsys):
    import minikv.serve
    from minikv.cli import main

    served = []
    monkeypatch.setattr(minikv.serve, "run", lambda llm, *a, **k: served.append(llm))
    assert main(["serve", "--model", "tiny-random", "--port", "0", "--no-engine-process", "--speculative", "ngram",
                 "--num-speculative-tokens", "4"]) == 0
    cfg = served[0].engine_config
    assert (cfg.speculative, cfg.num_speculative_tokens) == ("ngram", 4)
    assert main(["serve", "--model", "tiny-random", "--port", "0", "--no-engine-process", "--speculative",
                 "draft"]) == 2
    assert "needs draft_model" in capsys.readouterr().err


def test_rollback_checker_passes_the_engines_rollback_and_names_a_wrong_order():
    from minikv.checks.rollback import check_rollback

    check_rollback(rollback_blocks, num_random=20)

    def first_to_last(block_table, num_computed_tokens, block_size, free):
        keep = -(-num_computed_tokens // block_size)
        for b in block_table[keep:]:
            free(b)
        del block_table[keep:]
    with pytest.raises(AssertionError, match="the last block first"):
        check_rollback(first_to_last, num_random=0)


def test_no_drafts_while_more_requests_run_than_speculative_disable_by_batch_size(tiny):
    spec = LLM(tiny.loaded, **TINY, speculative="draft", draft_model=tiny.loaded, speculative_disable_by_batch_size=1)
    spec.generate(REPEATS[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert spec.stats()["speculative"]["drafted"] == 0
    spec.generate(REPEATS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert spec.stats()["speculative"]["drafted"] > 0


def test_a_gpu_engine_stops_drafting_above_the_measured_batch_by_default(monkeypatch):
    """On a GPU, speculation stops above GPU_MAX_SPECULATIVE_BATCH requests (where n-gram drafts stopped
    paying on an H100) unless the option says otherwise; a CPU engine drafts at any batch."""
    import minikv.engine.config as config
    from minikv.engine.config import EngineConfig
    from minikv.engine.speculative import GPU_MAX_SPECULATIVE_BATCH

    assert EngineConfig.from_options(device="cpu", kv_backend="paged",
                                     speculative="ngram").speculative_disable_by_batch_size is None
    monkeypatch.setattr(config, "parse_device", lambda device: torch.device("cuda"))  # no GPU needed to decide
    gpu = EngineConfig.from_options(device="cuda", kv_backend="paged", speculative="ngram")
    assert gpu.speculative_disable_by_batch_size == GPU_MAX_SPECULATIVE_BATCH == 4
    assert EngineConfig.from_options(device="cuda", kv_backend="paged", speculative="ngram",
                                     speculative_disable_by_batch_size=64).speculative_disable_by_batch_size == 64
