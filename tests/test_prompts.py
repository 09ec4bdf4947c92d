"""A prompt is text, token ids or a dict; anything else is a ValueError saying what was given and what to
pass (issue 11, items 9 and 10). Nothing is silently converted: 1.7 is not token 1, "123" is not [1, 2, 3]."""
import numpy as np
import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.engine.prompts import is_single_prompt, parse_prompt, token_ids, validate_cache_salt


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


@pytest.mark.parametrize("prompt, ids", [
    ([5, 6, 7], [5, 6, 7]),
    ((5, 6, 7), [5, 6, 7]),
    (torch.tensor([5, 6, 7]), [5, 6, 7]),
    (np.array([5, 6, 7], dtype=np.int64), [5, 6, 7]),
    ([np.int64(5), 6], [5, 6]),
    ({"prompt_token_ids": (5, 6)}, [5, 6]),
    ({"prompt_token_ids": torch.tensor([5, 6])}, [5, 6]),
])
def test_token_ids_in_any_sequence_a_learner_would_pass_become_a_list_of_ints(prompt, ids):
    got, text, salt = parse_prompt(prompt, None, 512)
    assert got == ids and all(type(t) is int for t in got) and text is None and salt is None


def test_text_goes_through_the_tokenizer_and_keeps_its_salt():
    assert parse_prompt("ab cde", WordTokenizer(), 512) == ([2, 3], "ab cde", None)
    assert (parse_prompt({"prompt": "ab cde", "cache_salt": "alice"}, WordTokenizer(), 512)
            == ([2, 3], "ab cde", "alice"))
    assert parse_prompt({"prompt_token_ids": [1], "cache_salt": ""}, None, 512)[2] == ""


BAD = [
    ([1.7, 2], r"prompt\[0\] is 1.7 \(float\); token ids are integers"),
    ([1, 2.0], r"prompt\[1\] is 2.0 \(float\); token ids are integers"),
    ([True, 2], r"prompt\[0\] is True \(bool\)"),
    ({"prompt_token_ids": "123"}, r"prompt_token_ids must be a list of token ids \(ints\), got str '123' "
                                  r"\(pass text as a string prompt"),
    ({"prompt_token_ids": [[1, 2]]}, r"prompt_token_ids\[0\] is \[1, 2\]"),
    ({"prompt_token_ids": None}, "prompt_token_ids must be a list of token ids"),
    ({"prompt": [1, 2]}, "'prompt' must be text, got list.*pass token ids as 'prompt_token_ids'"),
    ({"promt": "hi"}, r"a dict prompt needs exactly one of 'prompt' \(text\) or 'prompt_token_ids'"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "a dict prompt needs exactly one of"),
    ({}, "a dict prompt needs exactly one of"),
    (5, r"a prompt is text, a list of token ids or a dict, got int 5; wrap one token id in a list"),
    (None, "a prompt is text, a list of token ids or a dict, got NoneType None"),
    (3.5, "a prompt is text, a list of token ids or a dict, got float"),
    (torch.tensor([[1, 2], [3, 4]]), r"prompt must be 1-D \(one prompt\), got a tensor of shape \(2, 2\)"),
    (torch.tensor(7), r"prompt must be 1-D \(one prompt\), got a tensor of shape \(\)"),
    (torch.tensor([1.5, 2.0]), r"prompt\[0\] is 1.5 \(float\)"),
    ([], "prompt is empty; give at least one token"),
    ((), "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ([1, 512], r"token id 512 is outside the vocabulary \[0, 512\); use ids from this model's tokenizer"),
    ([-1], r"token id -1 is outside the vocabulary"),
    ("hello", "loaded without a tokenizer; pass prompts as lists of token ids"),
    ({"prompt_token_ids": [1], "cache_salt": 1}, r"cache_salt must be a string or None, got 1 \(int\)"),
    ({"prompt_token_ids": [1], "cache_salt": True}, "cache_salt must be a string or None, got True"),
    ({"prompt_token_ids": [1], "cache_salt": 5.0}, "cache_salt must be a string or None, got 5.0"),
    ({"prompt_token_ids": [1], "cache_salt": ["a"]}, "cache_salt must be a string or None"),
]


@pytest.mark.parametrize("prompt, message", BAD, ids=[repr(p) for p, _ in BAD])
def test_bad_prompt_is_a_value_error_saying_what_to_pass(prompt, message):
    with pytest.raises(ValueError, match=message):
        parse_prompt(prompt, None, 512)


def test_validate_cache_salt():
    assert validate_cache_salt(None) is None and validate_cache_salt("bob") == "bob"
    for salt in (0, 1, True, 5.0, b"x", ("a",)):
        with pytest.raises(ValueError, match="cache_salt must be a string or None"):
            validate_cache_salt(salt)


def test_token_ids_names_its_argument():
    with pytest.raises(ValueError, match=r"ids\[1\] is 'x'"):
        token_ids([1, "x"], "ids")


def test_is_single_prompt():
    for one in ("hi", [1, 2], (1, 2), torch.tensor([1, 2]), {"prompt": "hi"}, [1.7, 2]):
        assert is_single_prompt(one)
    for many in (["a", "b"], [[1], [2]], [{"prompt": "a"}], []):
        assert not is_single_prompt(many)


# ---- through the engine: LLM.encode and a request that is refused leaves the engine serving ----

@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=32, prefix_caching="radix")


@pytest.mark.parametrize("prompt, message", [
    ([1.7, 2], r"prompt\[0\] is 1.7"),
    ({"prompt_token_ids": "123"}, "prompt_token_ids must be a list of token ids"),
    (None, "a prompt is text, a list of token ids or a dict"),
    (5, "wrap one token id in a list"),
    ({"prompt_token_ids": [5, 6, 7], "cache_salt": 1}, "cache_salt must be a string or None"),
    ({"prompt_token_ids": [5, 6, 7], "cache_salt": ["alice"]}, "cache_salt must be a string or None"),
])
def test_engine_refuses_a_bad_prompt_and_serves_the_next(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        tiny.add_request(prompt, SamplingParams(max_tokens=2))
    assert not tiny.has_unfinished()
    assert len(tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_engine_takes_a_tuple_or_a_tensor_as_the_ids_of_one_prompt(tiny):
    want = tiny.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids
    for prompt in ((5, 6, 7), torch.tensor([5, 6, 7])):
        assert tiny.encode(prompt)[0] == [5, 6, 7]
        seq = tiny.add_request(prompt, SamplingParams(max_tokens=3))
        while tiny.has_unfinished():
            tiny.step()
        assert seq.output_token_ids == want


def test_token_ids_are_checked_in_bulk_not_one_python_call_per_token():
    """A prompt of 10,000 ids is validated by a handful of C-level passes (type set, min, max): an 8k-token
    prefix hit used to spend longer checking its ids one `isinstance` at a time than running its step."""
    import sys

    from minikv.engine.prompts import parse_prompt

    ids = [(7 * i) % 5000 for i in range(10_000)]
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        got, _, _ = parse_prompt(ids, None, 5000)
    finally:
        sys.setprofile(None)
    assert got == ids and got is not ids
    assert calls < 50, f"{calls} calls to validate 10,000 ids: a per-token loop is back"


@pytest.mark.parametrize("ids, bad", [
    ([0, 4999], None), ([True, 3], None), ([np.int64(3), 4], None), ([3] * 9000 + [4999], None),
    ([5000], 5000), ([-1, 3], -1), ([3, 2**64], 2**64), ([2**70], 2**70), ([3] * 9000 + [-7], -7),
])
def test_the_range_check_takes_one_c_pass_and_names_the_first_bad_id(ids, bad):
    """check_token_range reads the ids as unsigned 64-bit ints in one C pass (a negative id, one past 2**64
    or a non-integer raises there) and falls back to min / max, which name the id; the border of the core
    (new_sequence) is where it runs, once per request."""
    from minikv.engine.prompts import check_token_range

    if bad is None:
        check_token_range(ids, 5000)
    else:
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary \[0, 5000\)"):
            check_token_range(ids, 5000)


def test_a_bad_id_is_refused_by_the_core_when_llm_request_leaves_the_range_to_it(tiny):
    request = tiny.request([5, 6, 10**6], SamplingParams(max_tokens=2))  # its form is fine: the range is the core's
    with pytest.raises(ValueError, match="token id 1000000 is outside the vocabulary"):
        tiny.core.add(request)
    with pytest.raises(ValueError, match="token id 1000000 is outside the vocabulary"):
        tiny.generate([[5, 6, 7], [5, 6, 10**6]], SamplingParams(max_tokens=2))
    assert not tiny.has_unfinished()  # neither request of the batch was queued
