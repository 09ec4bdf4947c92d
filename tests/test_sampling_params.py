"""SamplingParams refuses every value the sampler or the scheduler cannot use, naming the argument and
the fix (issue 11, items 2 and 10); every value it accepts runs."""
import math

import numpy as np
import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.engine.sampler import draw_key, sample
from minikv.engine.sampling_params import MAX_SEED, MIN_TEMPERATURE

BAD = [
    (dict(temperature=math.nan), "temperature must be >= 0 and finite"),
    (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    (dict(temperature=-1.0), "temperature must be >= 0 and finite"),
    (dict(temperature="0.7"), "temperature must be >= 0 and finite"),
    (dict(temperature=True), "temperature must be >= 0 and finite"),
    (dict(temperature=1e-45), r"temperature 1e-45 is below 1e-05.*use temperature=0 for greedy"),
    (dict(temperature=1e-6), r"temperature 1e-06 is below 1e-05"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\].*use 1.0 to disable"),
    (dict(top_p="0.9"), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be an integer >= 0 \(0 disables it"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(top_k=True), "top_k must be an integer >= 0"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=3.0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens="8"), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=None), "max_tokens must be an integer >= 1"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"),
    (dict(stop=5), "stop must be a string, a list of strings or None, got 5"),
    (dict(stop=[5]), "stop strings must be non-empty strings"),
    (dict(stop=["ok", ""]), "stop strings must be non-empty strings"),
    (dict(stop={"a": 1}), "stop must be a string, a list of strings or None"),
    (dict(priority="high"), "priority must be an integer"),
    (dict(priority=1.5), "priority must be an integer"),
    (dict(priority=None), "priority must be an integer"),
    (dict(seed="abc"), r"seed must be None or an integer in \[0, 2\*\*63 - n\]"),
    (dict(seed=1.5), "seed must be None or an integer"),
    (dict(seed=True), "seed must be None or an integer"),
    (dict(seed=-1), "seed must be None or an integer"),
    (dict(seed=2**64 - 1, n=2), rf"seed must be None or an integer in \[0, 2\*\*63 - n\] = \[0, {2**63 - 2}\]"),
    (dict(seed=2**63 - 1, n=2), "seed must be None or an integer"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=2.0), "n must be an integer >= 1"),
    (dict(n=True), "n must be an integer >= 1"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[repr(k) for k, _ in BAD])
def test_bad_value_is_a_value_error_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_accepted_spellings_are_normalised():
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    p = SamplingParams(max_tokens=np.int64(5), n=np.int32(2), seed=np.int64(3), top_k=np.int64(4),
                       temperature=np.float32(0.5), top_p=1, priority=-2)
    assert (p.max_tokens, p.n, p.seed, p.top_k, p.priority) == (5, 2, 3, 4, -2)
    assert type(p.max_tokens) is int and type(p.seed) is int and type(p.temperature) is float
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=MIN_TEMPERATURE).temperature == 1e-5


def test_the_smallest_temperature_accepted_samples_finite_probabilities():
    logits = torch.tensor([[80.0, -80.0, 79.999, 3.0]])
    p = SamplingParams(temperature=MIN_TEMPERATURE, seed=0)
    assert sample(logits, [p], [draw_key(0, 0)]) == [0]


@pytest.fixture(scope="module")
def paged():
    return LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=32, max_num_seqs=4)


def test_largest_seed_accepted_runs_every_sample(paged):
    """seed + i of the last sample is 2**63 - 1: torch takes it (2**64 - 1 + 1 overflowed before)."""
    top = MAX_SEED - 1
    out = paged.generate([[5, 6, 7]], SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=top))[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)
    alone = paged.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=1.0, seed=MAX_SEED))[0]
    assert out.outputs[1].token_ids == alone.token_ids


def test_issue_reproducer_tiny_temperature_is_refused_before_it_can_wedge_the_engine(paged):
    earlier = paged.add_request([5, 6, 7], SamplingParams(max_tokens=5, n=2, ignore_eos=True))
    with pytest.raises(ValueError, match="temperature 1e-45 is below"):
        paged.generate([[8, 9]], SamplingParams(max_tokens=3, temperature=1e-45))
    out = paged.generate([[10, 11]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2
    while paged.has_unfinished():
        paged.step()
    assert [len(s.output_token_ids) for s in [earlier] + earlier.forks] == [5, 5]
