"""The checkers of exercises 01 and 02 pass a correct implementation and catch each planted bug,
naming the first difference and the mistake."""
import pytest
import torch

from minikv import LLM
from minikv.checks import (
    check_causal_attention,
    check_causal_attention_in_engine,
    check_decode_step,
    check_decode_step_in_engine,
    first_difference,
)
from minikv.checks.attention import reference_causal_attention, reference_decode_step

# ---- implementations: one correct, and the same code with one planted bug each ---------------------

def attention(q, k, v, scale, *, q_pos, scaled=True, mask="causal", grouping="interleave"):
    """q [Tq, H, D] at positions q_pos; k/v [L, KV, D]. Written apart from the engine on purpose."""
    H, KV = q.shape[1], k.shape[1]
    if grouping == "interleave":
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    else:
        k, v = k.repeat(1, H // KV, 1), v.repeat(1, H // KV, 1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * (scale if scaled else 1.0)
    j, i = torch.arange(k.shape[0])[None, :], torch.as_tensor(q_pos)[:, None]
    keep = {"causal": j <= i, "strict": j < i, "ahead": j <= i + 1, "none": j >= 0}[mask]
    weights = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.einsum("hij,jhd->ihd", weights, v)


def causal(**bug):
    def causal_attention(q, k, v, scale):
        return attention(q, k, v, scale, q_pos=torch.arange(q.shape[0]), **bug)
    return causal_attention


def decode(write_at=0, read="through_pos", write_first=True, in_place=True, clobber_rest=False, **bug):
    def decode_step(q, k_new, v_new, k_cache, v_cache, pos, scale):
        if not in_place:
            k_cache, v_cache = k_cache.clone(), v_cache.clone()
        if write_first:
            k_cache[pos + write_at], v_cache[pos + write_at] = k_new, v_new
        if clobber_rest:
            k_cache[pos + 1:], v_cache[pos + 1:] = 0, 0
        end = {"through_pos": pos + 1, "before_pos": pos, "whole_row": k_cache.shape[0]}[read]
        out = attention(q[None], k_cache[:end], v_cache[:end], scale, q_pos=[pos], **bug)[0]
        if not write_first:
            k_cache[pos], v_cache[pos] = k_new, v_new
        return out.nan_to_num(0.0) if end == 0 else out
    return decode_step


def failure(check, fn) -> str:
    with pytest.raises(AssertionError) as info:
        check(fn)
    return str(info.value)


# ---- exercise 01 ------------------------------------------------------------------------------------

def test_causal_checker_passes_a_correct_implementation(capsys):
    check_causal_attention(causal())
    assert "all 25 cases passed" in capsys.readouterr().out


def test_causal_checker_passes_the_engine_reference():
    check_causal_attention(reference_causal_attention, num_cases=40, seed=3)


def test_causal_checker_catches_missing_scale():
    msg = failure(check_causal_attention, causal(scaled=False))
    assert msg.startswith("case 1 ")  # case 0 has one token: softmax of one score is 1 whatever the scale
    assert "WITHOUT the scale" in msg


def test_causal_checker_catches_missing_mask():
    msg = failure(check_causal_attention, causal(mask="none"))
    assert "first difference at position 0, head 0" in msg  # position 0 saw the future
    assert "NO causal mask" in msg


def test_causal_checker_catches_mask_hiding_the_token_itself():
    msg = failure(check_causal_attention, causal(mask="strict"))
    assert msg.startswith("case 0 ") and "got nan" in msg
    assert "INCLUDING i" in msg


def test_causal_checker_catches_off_by_one_mask():
    msg = failure(check_causal_attention, causal(mask="ahead"))
    assert "wrong at position 0, 1, 2 of 0..3" in msg  # the last token has no token i+1 to peek at
    assert "off by one" in msg


def test_causal_checker_catches_wrong_head_grouping():
    msg = failure(check_causal_attention, causal(grouping="repeat"))
    assert "num_heads=4, num_kv_heads=2" in msg  # the first case with more than one kv head AND a group > 1
    assert "head 1, 2 of 0..3" in msg  # heads 0 and 3 read the same kv head either way
    assert "repeat_interleave" in msg


def test_causal_checker_catches_softmax_over_queries():
    def softmax_over_queries(q, k, v, scale):
        T = q.shape[0]
        scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("hij,jhd->ihd", scores.softmax(dim=-2), v.repeat_interleave(q.shape[1] // k.shape[1], 1))

    assert "normalize over the keys" in failure(check_causal_attention, softmax_over_queries)


def test_causal_checker_explains_a_missing_return_and_a_wrong_shape():
    assert "forget to `return`" in failure(check_causal_attention, lambda q, k, v, scale: None)
    extra_axis = lambda q, k, v, scale: causal()(q, k, v, scale)[None]  # noqa: E731
    assert "got shape (1, 1, 1, 4)" in failure(check_causal_attention, extra_axis)


# ---- exercise 02 ------------------------------------------------------------------------------------

def test_decode_checker_passes_a_correct_implementation(capsys):
    check_decode_step(decode())
    assert "all 25 cases passed" in capsys.readouterr().out


def test_decode_checker_passes_the_engine_reference():
    check_decode_step(reference_decode_step, num_cases=40, seed=3)


def test_decode_checker_catches_write_one_position_late():
    msg = failure(check_decode_step, decode(write_at=1))
    assert "k_cache after the call differs" in msg and "wrong at position 0, 1 of 0..3" in msg
    assert "written at pos + 1" in msg


def test_decode_checker_catches_writing_into_a_copy():
    assert "not into a copy" in failure(check_decode_step, decode(in_place=False))


def test_decode_checker_catches_touching_other_positions():
    assert "only k_cache[pos] may change" in failure(check_decode_step, decode(clobber_rest=True))


def test_decode_checker_catches_reading_stale_positions():
    assert "WHOLE row" in failure(check_decode_step, decode(read="whole_row", mask="none"))  # sliced too far, no mask


def test_decode_checker_catches_leaving_out_the_new_token():
    msg = failure(check_decode_step, decode(read="before_pos"))
    assert msg.startswith("case 0 ") and "leaves out the new token" in msg


def test_decode_checker_catches_attending_before_writing():
    assert "BEFORE the new K/V were written" in failure(check_decode_step, decode(write_first=False))


def test_decode_checker_catches_missing_scale_and_wrong_grouping():
    assert "WITHOUT the scale" in failure(check_decode_step, decode(scaled=False))
    msg = failure(check_decode_step, decode(grouping="repeat"))
    assert "wrong at head 1, 2 of 0..3" in msg and "repeat_interleave" in msg


# ---- the shared report ------------------------------------------------------------------------------

def test_first_difference_is_none_when_close_and_names_the_first_wrong_index():
    a = torch.zeros(3, 2, 4)
    assert first_difference(a, a + 1e-6, ("position", "head", "dim")) is None
    b = a.clone()
    b[2, 1, 3], b[1, 0, 0] = 5.0, -1.0
    msg = first_difference(a, b, ("position", "head", "dim"))
    assert msg.splitlines()[0] == "first difference at position 1, head 0, dim 0: expected 0.0000, got -1.0000"
    assert "wrong at position 1, 2 of 0..2; head 0, 1 of 0..1 (2 of 24 numbers, max abs error 5)" in msg


# ---- plugged into the engine (tiny-random: fast, no tokenizer) ----------------------------------------

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]


def test_in_engine_checks_pass_correct_functions(capsys):
    check_causal_attention_in_engine(LLM("tiny-random", kv_backend="naive"), causal(), PROMPT, max_tokens=8)
    check_decode_step_in_engine(LLM("tiny-random", kv_backend="contiguous"), decode(), PROMPT, max_tokens=8)
    assert capsys.readouterr().out.count("the engine generated the same 8 tokens") == 2


def test_in_engine_checks_catch_a_wrong_function_and_leave_the_engine_usable():
    llm = LLM("tiny-random", kv_backend="contiguous")
    with pytest.raises(AssertionError, match="generated token"):
        check_decode_step_in_engine(llm, decode(scaled=False), PROMPT, max_tokens=8)
    assert llm.runner.backend is llm.backend and len(llm.backend.pool.free_rows) == 4
    with pytest.raises(AssertionError, match="generated token"):
        check_causal_attention_in_engine(LLM("tiny-random", kv_backend="naive"), causal(mask="none"), PROMPT, 8)
