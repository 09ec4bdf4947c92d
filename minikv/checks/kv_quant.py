"""Checker for exercise 09a: quantize one block of K or V to 8 bits with its scales (and int8's zero
points), and back.

    quantize_block(x, dtype) -> (q, scale, zero)
        x      [block_size, num_kv_heads, head_dim] float (any leading shape works: [..., head_dim])
        dtype  torch.int8 or torch.float8_e4m3fn
        q      same shape as x, in dtype; scale [block_size, num_kv_heads] float32, one per token and head
        int8:  the row's [min, max] onto [-127, 127]: zero = (max + min) / 2, scale = (max - min) / 2 / 127,
               x ~ q * scale + zero (zero [block_size, num_kv_heads] float32)
        fp8:   symmetric: scale = absmax of the row / 448, x ~ q * scale, zero None
    dequantize_block(q, scale, zero) -> q * scale (+ zero) as float32

Three stages, each stopping at the first problem with a message that says where:
  1. quantize_block on random blocks and on the blocks that break naive quantizers (an outlier
     channel, a row of zeros, an all-zero block, a constant block, a row whose largest value is
     negative, a row of one sign, huge and tiny magnitudes): shapes and dtypes, the scale and zero
     point (not a wider range, which wastes levels, not a narrower one, which clips), and the
     round-trip error (half a step of the grid at most). A NaN or inf that reaches the conversion to
     8 bits fails, whatever the conversion makes of it: float -> int8 of NaN is undefined, and this
     CPU happens to give 0, which would hide a missing zero-range guard
  2. dequantize_block against q * scale + zero
  3. (check_kv_quant_in_engine) SmolLM2 on an int8 pool whose K/V are stored by your quantize_block
     (`llm.derive(kv_quantizer=quantize_block)`, built when the check runs, so it always runs the
     function you defined last): the same greedy tokens as the engine's own quantizer
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from minikv.cache.blocks.quant import QMAX
from minikv.cache.blocks.quant import dequantize_block as reference_dequantize
from minikv.cache.blocks.quant import quantize_block as reference_quantize
from minikv.checks.report import fail, first_difference, passed

DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
BLOCK = (16, 3, 64)  # block_size, num_kv_heads, head_dim


def blocks(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(lesson, x [16, 3, 64]) cases: random, then the ones that break naive quantizers."""
    g = torch.Generator().manual_seed(seed)
    r = lambda scale=1.0: torch.randn(BLOCK, generator=g) * scale  # noqa: E731
    outlier = r()
    outlier[:, :, 5] *= 40  # one channel 40x the others in every token (as keys have)
    zeros = r()
    zeros[3, 1] = 0  # a row of zeros: its scale is 0 and must not give NaN
    negative = r()
    negative[:, :, 7] = -25  # the largest magnitude of every row is negative
    one_sign = r().abs() + 3  # every value in [3, 7]: a grid symmetric around 0 wastes half its levels
    mixed = r() * torch.logspace(-3, 3, BLOCK[0])[:, None, None]  # tokens of very different sizes
    constant = torch.arange(BLOCK[0] * BLOCK[1], dtype=torch.float32).reshape(BLOCK[:2])[..., None] / 4 - 5
    constant = constant.expand(BLOCK).contiguous()  # every row one value (-5 .. 6.75): range 0, scale 0
    return [("a random block", r()), ("a random block with large values", r(300)),
            ("an outlier channel (channel 5 is 40x the others)", outlier), ("a row of zeros (token 3, head 1)", zeros),
            ("an all-zero block", torch.zeros(BLOCK)), ("a constant block (each row one value, -5 to 6.75)", constant),
            ("rows whose largest magnitude is negative", negative), ("rows of one sign (values in [3, 7])", one_sign),
            ("tokens from 1e-3 to 1e3", mixed)]


class _WatchConversions(TorchFunctionMode):
    """Sees every torch call of the learner's function: the first one that makes an 8-bit tensor out of a
    float tensor holding NaN or inf is kept in `bad`. What such a conversion returns is undefined (this
    CPU turns NaN into int8 0, others into -128), so the output alone cannot tell a guard from luck."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.bad = dtype, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.bad is None and isinstance(out, torch.Tensor) and out.dtype == self.dtype:
            inputs = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            for a in inputs:
                if a.is_floating_point() and not torch.isfinite(a).all():
                    self.bad = (getattr(func, "__name__", str(func)), int((~torch.isfinite(a)).sum()))
                    break
        return out


def _bound(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The largest round-trip error a correct 8-bit value may have, per element."""
    if dtype == torch.int8:  # a uniform grid, step = scale: half a step (and the rounding of the zero point)
        return (scale[..., None] / 2 * (1 + 1e-5) + zero.abs()[..., None] * 1e-6 + 1e-12).expand_as(x)
    # e4m3: 3 mantissa bits, half an ulp is at most 1/16 of the value; below 2^-6 (subnormals) the step is 2^-9
    return torch.maximum(x.abs() / 16, scale[..., None] * 2.0**-10) * (1 + 1e-5) + 1e-12


def _call(case: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, f"{fn.__name__} raised {type(e).__name__}", str(e))


def _is_row_tensor(t, x: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.shape == x.shape[:-1] and t.dtype == torch.float32


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_quantize_block(quantize_block, dtypes=("int8", "fp8")) -> None:
    n = 0
    for name in dtypes:
        dtype, qmax = DTYPES[name], QMAX[DTYPES[name]]
        int8 = dtype == torch.int8
        for lesson, x in blocks():
            case = f"{name}, {lesson}: x {list(x.shape)} [block_size, num_kv_heads, head_dim]"
            with _WatchConversions(dtype) as watch:
                out = _call(case, quantize_block, x.clone(), dtype)
            if watch.bad is not None:
                op, count = watch.bad
                fail(case, f"{count} NaN or inf values reached the conversion to {dtype} (in {op})",
                     "a row whose values are all equal has range 0, so its scale is 0 and (x - zero) / scale is "
                     "0 / 0 = NaN. What converting NaN gives is undefined: 0 on some CPUs, -128 on others, NaN "
                     "in fp8; the stored value is then luck, not your code",
                     "divide by the scale only where it is > 0 (torch.where(half > 0, qmax / half, 0)): a "
                     "constant row gets q 0 and keeps its value exactly in the zero point (fp8: scale 0, q 0)")
            if not (isinstance(out, tuple) and len(out) == 3):
                fail(case, f"quantize_block returned {type(out).__name__}"
                           + (f" of {len(out)}" if isinstance(out, tuple) else ""),
                     "expected a triple (q, scale, zero): zero is the zero point for int8, None for fp8")
            q, scale, zero = out
            if not isinstance(q, torch.Tensor) or q.shape != x.shape or q.dtype != dtype:
                fail(case, f"q is {_describe(q)}",
                     f"expected {dtype} {tuple(x.shape)}: one 8-bit value per element of x",
                     "convert at the end: .to(dtype) (for int8, after rounding and clamping)")
            if not _is_row_tensor(scale, x):
                fail(case, f"scale is {_describe(scale)}",
                     f"expected float32 {tuple(x.shape[:-1])}: one scale per token and KV head",
                     "reduce over the last dimension only: x.amax(dim=-1), x.amin(dim=-1), x.abs().amax(dim=-1)")
            if int8 and not _is_row_tensor(zero, x):
                fail(case, f"zero is {_describe(zero)}",
                     f"expected float32 {tuple(x.shape[:-1])}: one zero point per token and KV head, the middle "
                     "of the row's range", "zero = (x.amax(dim=-1) + x.amin(dim=-1)) / 2")
            if not int8 and zero is not None:
                fail(case, f"zero is {_describe(zero)}", "expected None: fp8 is symmetric around 0",
                     "e4m3's levels are densest near 0; shifting a row would move its small values where the "
                     "steps are coarse. Return (q, scale, None)")
            for what, t in (("scale", scale), ("zero", zero if int8 else None)):
                if t is not None and not torch.isfinite(t).all():
                    fail(case, f"{what} holds NaN or inf", "every row's scale and zero point must be finite numbers "
                         "(a constant row: scale 0)", "compute them from the row's max and min only")
            xf = x.float()
            if int8:
                hi, lo = xf.amax(-1), xf.amin(-1)
                for what, want, got in [("zero points", (hi + lo) / 2, zero), ("scales", (hi - lo) / 2 / qmax, scale)]:
                    bad = first_difference(want, got, ("token", "head"), atol=1e-12, rtol=1e-5)
                    if bad:
                        fail(case, f"the {what} differ from the row's " + (
                            "middle (max + min) / 2" if what == "zero points" else "half range (max - min) / 2 / 127"),
                             bad, "int8 maps the row's [min, max] onto [-127, 127], not [-absmax, absmax]: "
                                  "zero = (max + min) / 2, scale = (max - min) / 2 / 127 (max and min, not absmax)")
            else:
                want_scale = xf.abs().amax(-1) / qmax
                bad = first_difference(want_scale, scale, ("token", "head"), atol=0, rtol=1e-5)
                if bad:
                    big = (scale > want_scale * (1 + 1e-5)).any()
                    why = "a larger scale leaves levels unused" if big else "a smaller scale clips the largest values"
                    fail(case, "the scales differ from absmax / qmax", bad,
                         f"the largest magnitude of a row must land on +-{qmax:g}: {why} "
                         "(absmax, not max: the largest value may be negative)")
            got = q.float() * scale[..., None] + (zero[..., None] if int8 else 0)
            if not torch.isfinite(got).all():
                fail(case, "q * scale has NaN or inf", "a row of zeros (or any constant row) has scale 0: q must be 0",
                     "divide by the scale only where it is > 0 (torch.where)")
            # rows of one value (int8) or of zeros (fp8): q 0 must give them back exactly
            flat = (xf.amax(-1) == xf.amin(-1)) if int8 else (xf.abs().amax(-1) == 0)
            if flat.any() and not torch.equal(got[flat], xf[flat]):
                i = [int(v) for v in torch.nonzero(flat & (got != xf).any(-1))[0]]
                fail(case, f"a constant row does not come back exactly (token {i[0]}, head {i[1]})",
                     f"x = {xf[i[0], i[1], 0].item():.6g} in every dim, dequantized {got[i[0], i[1]][:4].tolist()} ...",
                     "a row of one value has scale 0: its q must be 0 and its zero point the value itself"
                     if int8 else "a row of zeros has scale 0: its q must be 0")
            err, bound = (got - xf).abs(), _bound(xf, scale, zero, dtype)
            over = err > bound
            if over.any():
                i = [int(v) for v in torch.nonzero(over)[0]]
                fail(case, "the round trip q * scale" + (" + zero" if int8 else "") + " is too far from x",
                     f"at token {i[0]}, head {i[1]}, dim {i[2]}: x = {x[tuple(i)].item():.6g}, dequantized "
                     f"{got[tuple(i)].item():.6g}, error {err[tuple(i)].item():.3g} > {bound[tuple(i)].item():.3g} "
                     f"({int(over.sum())} of {over.numel()} values)",
                     "round (x - zero) / scale to the nearest level (torch.floor(y + 0.5)), never truncate"
                     if int8 else "clamp x / scale to [-448, 448], then .to(torch.float8_e4m3fn)")
            n += 1
    passed(n, f"quantize_block gives a scale (int8: and a zero point) per token and KV head, and a round trip "
              f"within half a step ({', '.join(dtypes)})")


def check_dequantize_block(dequantize_block) -> None:
    n = 0
    for name, dtype in DTYPES.items():
        for lesson, x in blocks(seed=1):
            case = f"{name}, {lesson}"
            q, scale, zero = reference_quantize(x, dtype)
            got = _call(case, dequantize_block, q, scale, zero)
            bad = first_difference(reference_dequantize(q, scale, zero), got, ("token", "head", "dim"), atol=0,
                                   rtol=1e-6)
            if bad:
                fail(case, "dequantize_block(q, scale, zero) differs from q * scale + zero", bad,
                     "convert q to float32 first, give scale and zero a last dimension (scale[..., None]), "
                     "and add zero only when it is not None (fp8)")
            if got.dtype != torch.float32:
                fail(case, f"got {got.dtype}", "expected float32")
            n += 1
    passed(n, "dequantize_block gives q * scale + zero in float32")


def check_kv_quant_in_engine(llm, quantize_block, prompts: list[str], max_tokens: int = 12) -> dict:
    """Your quantize_block fills an int8 (or fp8) pool: `llm.derive(kv_quantizer=quantize_block)`, built
    here from `llm`'s weights and options each time the check runs, so a fixed function is checked
    without rebuilding anything. Its greedy tokens must equal those of the engine's own quantizer on the
    same pool (`llm.derive(kv_quantizer=None)`). Returns the tokens before the first difference from a
    full-precision pool, yours and the engine's."""
    from minikv import SamplingParams
    from minikv.bench import first_divergence

    cfg = llm.engine_config
    if cfg.kv_cache_dtype == "auto":
        raise ValueError("build the LLM with kv_backend='paged' and kv_cache_dtype='int8' (or 'fp8'): the check "
                         "stores its K/V with your quantize_block")
    calls = []

    def counted(x, dtype):
        calls.append(x.shape[0])
        return quantize_block(x, dtype)

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    mine = [o.token_ids for o in llm.derive(kv_quantizer=counted).generate(prompts, params)]
    engine = [o.token_ids for o in llm.derive(kv_quantizer=None).generate(prompts, params)]
    full = [o.token_ids for o in llm.derive(kv_quantizer=None, kv_cache_dtype="auto").generate(prompts, params)]
    if not calls:
        fail("the engine run", "your quantizer was never called", "the pool stored K/V without it",
             "the engine calls its kv_quantizer on every K and V it stores: is the pool quantized?")
    for prompt, got, want in zip(prompts, mine, engine):
        if got != want:
            i = first_divergence(got, want)
            fail(f"prompt {prompt!r}", f"greedy token {i} differs from the engine's own {cfg.kv_cache_dtype} pool",
                 f"expected {want}\ngot      {got}",
                 "does check 1 pass? The engine dequantizes q * scale + zero: scale and zero must come from "
                 "the row you are given (int8: its max and min; fp8: its absmax)")
    agree = {"yours": [], "engine": []}
    for got, want, ref in zip(mine, engine, full):
        for key, toks in (("yours", got), ("engine", want)):
            d = first_divergence(toks, ref)
            agree[key].append(max_tokens if d is None else d)
    passed(len(prompts), f"the engine on a pool of {cfg.kv_cache_dtype} filled by your quantize_block "
                         f"({len(calls)} stores) gives the engine's own tokens; tokens before the first "
                         f"difference from the full-precision pool: {agree['yours']} of {max_tokens}")
    return agree
