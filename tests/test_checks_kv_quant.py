"""Exercise 09a's checker (quantize and dequantize one block with its scales) passes the reference
answers, catches the mistakes learners make and names them, and plugs the learner's quantizer into
the engine through the kv_quantizer seam (tiny-random here; the notebook runs SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from minikv import LLM
from minikv.cache.quant import QMAX
from minikv.checks.kv_quant import check_dequantize_block, check_kv_quant_in_engine, check_quantize_block
from minikv.checks.report import CheckFailed


def quantize_block(x, dtype):
    qmax = QMAX[dtype]
    absmax = x.float().abs().amax(dim=-1)
    inv = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
    y = x.float() * inv[..., None]
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.clamp(-qmax, qmax).to(dtype), absmax / qmax


def dequantize_block(q, scale):
    return q.float() * scale[..., None]


def per_block_scale(x, dtype):  # one scale for the whole block
    q, _ = quantize_block(x, dtype)
    return q, x.abs().amax() / QMAX[dtype]


def max_not_absmax(x, dtype):
    qmax = QMAX[dtype]
    m = x.float().amax(dim=-1).clamp(min=1e-8)
    return (x / m[..., None] * qmax).round().clamp(-qmax, qmax).to(dtype), m / qmax


def truncates(x, dtype):
    qmax = QMAX[dtype]
    s = x.abs().amax(dim=-1) / qmax
    return (x / torch.where(s > 0, s, 1)[..., None]).to(dtype), s  # int8 conversion truncates toward zero


def divides_by_zero(x, dtype):
    s = x.abs().amax(dim=-1) / QMAX[dtype]
    return (x / s[..., None]).to(dtype), s  # (fp8: the conversion rounds)


def spare_range(x, dtype):  # the largest value lands on 100, not 127: 27 levels unused
    s = x.abs().amax(dim=-1) / 100
    return torch.floor(x / torch.where(s > 0, s, 1)[..., None] + 0.5).to(dtype), s


def test_the_reference_answers_pass(capsys):
    check_quantize_block(quantize_block)
    check_dequantize_block(dequantize_block)
    assert "all 12 cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, dtype, says", [
    (per_block_scale, "int8", "one scale per token and KV head"),
    (max_not_absmax, "int8", "absmax, not max"),
    (truncates, "int8", "round to the nearest level"),
    (divides_by_zero, "fp8", "divide by the scale only where it is > 0"),  # 0/0 = NaN, which e4m3 keeps
    (spare_range, "int8", "a larger scale leaves levels unused"),
])
def test_common_mistakes_are_caught_and_named(wrong, dtype, says):
    with pytest.raises(CheckFailed, match=says):
        check_quantize_block(wrong, dtypes=(dtype,))


def test_a_dequantize_without_the_scale_axis_is_named():
    with pytest.raises(CheckFailed, match=r"scale\[\.\.\., None\]"):
        check_dequantize_block(lambda q, s: q.float() * s.mean())


def test_the_learners_quantizer_fills_the_engines_pool_through_the_seam(capsys):
    llm = LLM("tiny-random", kv_backend="paged", block_size=8, num_blocks=32, kv_cache_dtype="int8",
              kv_quantizer=quantize_block)
    agree = check_kv_quant_in_engine(llm, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]], max_tokens=4)
    assert "gives the engine's own tokens" in capsys.readouterr().out and len(agree["yours"]) == 2

    def wide_scale(x, dtype):  # dequantizes to 1.5x the values it was given
        q, scale = quantize_block(x, dtype)
        return q, scale * 1.5

    with pytest.raises(CheckFailed, match="differs from the engine's own int8 pool"):
        check_kv_quant_in_engine(llm.derive(kv_quantizer=wide_scale), [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]],
                                 max_tokens=4)
