"""The EngineCore: plain requests in, plain events out, the one place a step happens.

The offline LLM and the server are both clients of these events; here the core is driven alone,
as a client in another process would drive it."""
import dataclasses
import pickle
from pathlib import Path

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.config import EngineConfig
from minikv.engine.core import EngineCore, EngineEvent, EngineRequest

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)

PAGED = dict(kv_backend="paged", block_size=4, num_blocks=64, max_num_seqs=4, prefix_caching="hash")
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 8]]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", **PAGED)


def drive(core: EngineCore, requests: list[EngineRequest]) -> list[EngineEvent]:
    for r in requests:
        core.add(r)
    events = []
    while core.has_unfinished():
        events += core.step()
    return events + core.take_events()


def test_a_core_driven_alone_gives_the_tokens_and_text_of_generate(llm):
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=4, temperature=0.9, seed=3),
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=1, ignore_eos=True)]
    want = llm.generate(PROMPTS, params)
    core = llm.derive().core
    events = drive(core, [EngineRequest(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params))])
    for i, out in enumerate(want):
        for sample in out.outputs:
            mine = [e for e in events if e.request_id == f"r{i}" and e.index == sample.index]
            assert [e.token_id for e in mine if e.token_id is not None] == sample.token_ids
            assert "".join(e.text_delta for e in mine) == sample.text
            assert mine[-1].finish_reason == sample.finish_reason
    assert core.num_requests() == 0


def test_a_requests_last_event_carries_its_usage_and_no_other_does(llm):
    core = llm.derive().core
    events = drive(core, [EngineRequest(PROMPTS[0], SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=2,
                                                                   ignore_eos=True), request_id="a")])
    with_usage = [e for e in events if e.usage is not None]
    assert with_usage == [events[-1]] and events[-1].request_finished
    u = events[-1].usage
    assert (u.prompt_tokens, u.completion_tokens) == (len(PROMPTS[0]), 6)
    assert len(u.token_times) == 3 and u.time_to_first_token > 0


def test_requests_and_events_are_plain_data_that_cross_a_process_boundary(llm):
    core = llm.derive().core
    request = EngineRequest(PROMPTS[1], SamplingParams(max_tokens=3), request_id="x", cache_salt="alice", tenant="t")
    assert pickle.loads(pickle.dumps(request)) == request
    events = drive(core, [request])
    assert pickle.loads(pickle.dumps(events)) == events
    assert all(isinstance(v, (str, int, type(None))) for e in events
               for k, v in dataclasses.asdict(e).items() if k != "usage")


def test_abort_by_id_ends_every_sample_with_an_event_and_frees_its_blocks(llm):
    core = llm.derive().core
    core.add(EngineRequest(PROMPTS[0], SamplingParams(max_tokens=50, n=2, temperature=1.0, ignore_eos=True),
                           request_id="long"))
    for _ in range(3):
        core.step()
    core.abort("long")
    last = core.take_events()
    assert {e.index for e in last} == {0, 1} and all(e.finish_reason == "abort" for e in last)
    assert last[-1].usage is not None and core.num_requests() == 0
    assert core.view.used_blocks == 0
    core.abort("long")  # finished already: nothing happens
    core.abort("never-sent")
    assert core.take_events() == []


def test_a_second_live_request_with_the_same_id_is_refused_and_changes_nothing(llm):
    core = llm.derive().core
    core.add(EngineRequest(PROMPTS[0], SamplingParams(max_tokens=4), request_id="same"))
    with pytest.raises(ValueError, match="request id 'same' is already running; give each live request its own id"):
        core.add(EngineRequest(PROMPTS[1], SamplingParams(max_tokens=4), request_id="same"))
    events = drive(core, [])
    assert {e.request_id for e in events} == {"same"} and events[-1].usage.prompt_tokens == len(PROMPTS[0])
    core.add(EngineRequest(PROMPTS[1], SamplingParams(max_tokens=2), request_id="same"))  # finished: free again


def test_the_core_checks_what_it_is_given_at_its_border(llm):
    core = llm.core
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add(EngineRequest([1, 10**6]))
    with pytest.raises(ValueError, match="prompt has 257 tokens but the KV pool holds only 256"):
        core.add(EngineRequest([1] * (core.max_model_len + 1)))
    with pytest.raises(ValueError, match="EngineRequest"):
        core.add({"prompt_token_ids": [1, 2]})
    assert core.num_requests() == 0 and not core.has_unfinished()


def test_the_server_loop_has_no_token_or_text_bookkeeping_of_its_own():
    """The deltas are the core's, or the detokenizer's own TextStream's when the core sends ids only: the
    engine loop never reads a sequence's tokens or text, nor decodes with logic of its own."""
    source = (Path(__file__).resolve().parent.parent / "minikv" / "serve" / "engine_loop.py").read_text()
    for name in ("output_token_ids", ".text[", "samples_of", "detokenize(", ".decode("):
        assert name not in source, name


# ---- the frozen config -------------------------------------------------------------------------
def test_a_config_is_frozen_and_fit_returns_a_new_one():
    cfg = EngineConfig.from_options(kv_backend="paged", block_size=4, num_blocks=10, device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pool.block_size = 8
    fitted = cfg.fit(max_positions=2048, bytes_per_block=1024)
    assert cfg.max_model_len is None and cfg.max_num_seqs is None and not cfg.fitted and dict(cfg.chosen) == {}
    assert (fitted.max_model_len, fitted.max_num_seqs) == (40, 32) and fitted.fitted
    assert fitted.scheduling.max_num_seqs == fitted.max_num_seqs and "max_num_seqs" in fitted.chosen
    with pytest.raises(TypeError):
        fitted.chosen["num_blocks"] = "mine"
    with pytest.raises(ValueError, match="fitted already"):
        fitted.fit(max_positions=2048, bytes_per_block=1024)


def test_what_fit_chose_is_an_output_never_an_option():
    with pytest.raises(ValueError, match="unknown option 'chosen'"):
        EngineConfig.from_options(chosen={"num_blocks": "mine"})
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM("tiny-random", max_num_seq=4)


def test_the_config_parts_hold_every_option_once():
    from minikv.engine.config import OPTIONS, PARTS, TOP_LEVEL

    names = list(TOP_LEVEL) + [f.name for part in PARTS.values() for f in dataclasses.fields(part)]
    assert len(names) == len(set(names)) == len(OPTIONS)
    cfg = EngineConfig.from_options(model="tiny-random", kv_backend="paged", copy_on_write=lambda *a: None)
    assert set(cfg.options()) == set(OPTIONS) and cfg.seams.copy_on_write is cfg.copy_on_write


def test_stats_report_the_time_to_first_token_of_hits_and_misses(llm):
    engine = llm.derive()
    shared = list(range(40, 72))  # 8 full blocks of 4
    engine.generate([shared + [1]], SamplingParams(max_tokens=2))
    outs = engine.generate([shared + [2], [300 + i for i in range(9)]], SamplingParams(max_tokens=2))
    assert outs[0].num_cached_tokens == 32 and outs[1].num_cached_tokens == 0
    pc = engine.stats()["prefix_cache"]
    assert pc["ttft_hit_median_s"] == outs[0].time_to_first_token
    assert pc["ttft_miss_median_s"] == outs[1].time_to_first_token
