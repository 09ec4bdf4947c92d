"""Exercise 09a's checker (quantize and dequantize one block with its scales) passes the reference
answers, catches the mistakes learners make and names them, and plugs the learner's quantizer into
the engine through the kv_quantizer seam (tiny-random here; the notebook runs SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from minikv import LLM
from minikv.cache.blocks.quant import QMAX
from minikv.checks.kv_quant import blocks, check_dequantize_block, check_kv_quant_in_engine, check_quantize_block
from minikv.checks.report import CheckFailed


def quantize_block(x, dtype):
    qmax = QMAX[dtype]
    x = x.float()
    if dtype == torch.int8:
        hi, lo = x.amax(dim=-1), x.amin(dim=-1)
        half, zero = (hi - lo) / 2, (hi + lo) / 2
        inv = torch.where(half > 0, qmax / half, torch.zeros_like(half))
        return torch.floor((x - zero[..., None]) * inv[..., None] + 0.5).clamp(-qmax, qmax).to(dtype), half / qmax, zero
    absmax = x.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    return (x * inv[..., None]).clamp(-qmax, qmax).to(dtype), absmax / qmax, None


def dequantize_block(q, scale, zero):
    x = q.float() * scale[..., None]
    return x if zero is None else x + zero[..., None]


def symmetric_int8(x, dtype):  # the grid spans [-absmax, absmax]: half its levels unused on a row of one sign
    qmax = QMAX[dtype]
    s = x.abs().amax(dim=-1) / qmax
    return torch.floor(x / torch.where(s > 0, s, 1)[..., None] + 0.5).to(dtype), s, torch.zeros_like(s)


def a_pair(x, dtype):  # (q, scale): no zero point
    return quantize_block(x, dtype)[:2]


def per_block_scale(x, dtype):  # one scale for the whole block
    q, _, zero = quantize_block(x, dtype)
    return q, x.abs().amax() / QMAX[dtype], zero


def max_not_absmax(x, dtype):
    qmax = QMAX[dtype]
    m = x.float().amax(dim=-1).clamp(min=1e-8)
    return (x / m[..., None] * qmax).clamp(-qmax, qmax).to(dtype), m / qmax, None


def truncates(x, dtype):
    q, scale, zero = quantize_block(x, dtype)
    inv = torch.where(scale > 0, 1 / scale, 0)
    return ((x - zero[..., None]) * inv[..., None]).to(dtype), scale, zero  # int8 conversion truncates toward zero


def divides_by_zero(x, dtype):
    s = x.abs().amax(dim=-1) / QMAX[dtype]
    return (x / s[..., None]).to(dtype), s, None  # (fp8: the conversion rounds)


def spare_range(x, dtype):  # the largest value lands on 300, not 448: levels unused
    s = x.abs().amax(dim=-1) / 300
    return (x / torch.where(s > 0, s, 1)[..., None]).to(dtype), s, None


def fp8_zero_point(x, dtype):  # shifts fp8 rows too
    q, scale, _ = quantize_block(x, dtype)
    return q, scale, torch.zeros_like(scale)


def no_zero_range_guard(x, dtype):  # divides by a scale of 0 on a constant row: 0 / 0 = NaN before the cast
    qmax = QMAX[dtype]
    x = x.float()
    hi, lo = x.amax(dim=-1), x.amin(dim=-1)
    scale, zero = (hi - lo) / 2 / qmax, (hi + lo) / 2
    q = torch.floor((x - zero[..., None]) / scale[..., None] + 0.5).clamp(-qmax, qmax).to(dtype)
    return q, scale, zero


def guard_after_the_division(x, dtype):  # correct: the NaN of a constant row is replaced before the cast
    qmax = QMAX[dtype]
    x = x.float()
    hi, lo = x.amax(dim=-1), x.amin(dim=-1)
    scale, zero = (hi - lo) / 2 / qmax, (hi + lo) / 2
    y = torch.where(scale[..., None] > 0, (x - zero[..., None]) / scale[..., None], 0)
    return torch.floor(y + 0.5).clamp(-qmax, qmax).to(dtype), scale, zero


def test_the_reference_answers_pass(capsys):
    check_quantize_block(quantize_block)
    check_dequantize_block(dequantize_block)
    assert "all 18 cases passed" in capsys.readouterr().out


def test_a_missing_zero_range_guard_fails_whatever_the_cpu_makes_of_nan():
    """Converting NaN to int8 is undefined (0 on this CPU, -128 on others): the stored q may happen to be
    right, so the checker looks at what reaches the conversion, on an all-zero and a constant block."""
    q, _, _ = no_zero_range_guard(torch.zeros(2, 8), torch.int8)  # what this CPU stores: no way to tell from q
    with pytest.raises(CheckFailed, match=r"NaN or inf values reached the conversion to torch.int8") as err:
        check_quantize_block(no_zero_range_guard, dtypes=("int8",))
    assert "divide by the scale only where it is > 0" in str(err.value)
    check_quantize_block(guard_after_the_division, dtypes=("int8",))  # a NaN replaced before the cast is fine


def test_the_blocks_include_an_all_zero_and_a_constant_block():
    lessons = dict(blocks())
    zero, constant = lessons["an all-zero block"], lessons["a constant block (each row one value, -5 to 6.75)"]
    assert not zero.any()
    assert (constant.amax(-1) == constant.amin(-1)).all() and constant[:, :, 0].unique().numel() == 48


@pytest.mark.parametrize("wrong, dtype, says", [
    (symmetric_int8, "int8", r"not \[-absmax, absmax\]"),
    (a_pair, "int8", r"expected a triple \(q, scale, zero\)"),
    (per_block_scale, "int8", "one scale per token and KV head"),
    (max_not_absmax, "fp8", "absmax, not max"),
    (truncates, "int8", "never truncate"),
    (divides_by_zero, "fp8", "divide by the scale only where it is > 0"),  # 0/0 = NaN, which e4m3 keeps
    (spare_range, "fp8", "a larger scale leaves levels unused"),
    (fp8_zero_point, "fp8", "fp8 is symmetric around 0"),
])
def test_common_mistakes_are_caught_and_named(wrong, dtype, says):
    with pytest.raises(CheckFailed, match=says):
        check_quantize_block(wrong, dtypes=(dtype,))


def test_a_dequantize_without_the_scale_axis_or_the_zero_point_is_named():
    with pytest.raises(CheckFailed, match=r"scale\[\.\.\., None\]"):
        check_dequantize_block(lambda q, s, z: q.float() * s.mean())
    with pytest.raises(CheckFailed, match="add zero only when it is not None"):
        check_dequantize_block(lambda q, s, z: q.float() * s[..., None])


def test_the_learners_quantizer_fills_the_engines_pool_through_the_seam(capsys):
    llm = LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=32, kv_cache_dtype="int8")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]]
    agree = check_kv_quant_in_engine(llm, quantize_block, prompts, max_tokens=4)
    assert "gives the engine's own tokens" in capsys.readouterr().out and len(agree["yours"]) == 2

    def wide_scale(x, dtype):  # dequantizes to 1.5x the values' spread
        q, scale, zero = quantize_block(x, dtype)
        return q, scale * 1.5, zero

    with pytest.raises(CheckFailed, match="differs from the engine's own int8 pool"):
        check_kv_quant_in_engine(llm, wide_scale, prompts, max_tokens=4)


def test_the_engine_check_runs_the_function_it_is_given_not_one_the_llm_was_built_with():
    """A learner who fixes quantize_block and re-runs only the check cell gets the fixed function checked,
    even when the set-up cell built its LLM around the broken one."""
    def wide_scale(x, dtype):
        q, scale, zero = quantize_block(x, dtype)
        return q, scale * 1.5, zero

    stale = LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=32, kv_cache_dtype="int8",
                kv_quantizer=wide_scale)
    check_kv_quant_in_engine(stale, quantize_block, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_tokens=4)
