"""Explain the FIRST way a learner's tensor differs from the reference, in words a learner can act on.

    first_difference(expected, got, dims=("position", "head", "dim"))
    -> None when they match, else e.g.

    first difference at position 2, head 1, dim 0: expected 0.4180, got -0.1212
    wrong at position 1, 2, 3 of 0..3; head 1, 3 of 0..3 (12 of 64 numbers, max abs error 0.91)

Listing which indexes along each axis are wrong is what points at the bug: a mask bug leaves
position 0 right, a head-grouping bug leaves head 0 right, a missing scale touches everything.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _where(index: Sequence[int], dims: Sequence[str]) -> str:
    return ", ".join(f"{name} {i}" for name, i in zip(dims, index))


def _index_list(indexes: list[int], size: int, limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in indexes[:limit]) + (", ..." if len(indexes) > limit else "")
    return f"{shown} of 0..{size - 1}"


def first_difference(expected: torch.Tensor, got, dims: Sequence[str], atol: float = 1e-4,
                     rtol: float = 1e-4) -> str | None:
    """None if `got` equals `expected` within atol + rtol * |expected|; else a short explanation."""
    dims = list(dims)
    want = f"a torch.Tensor of shape {tuple(expected.shape)} ({' x '.join(dims)})"
    if got is None:
        return f"got None; expected {want}. Did the function forget to `return`?"
    if not isinstance(got, torch.Tensor):
        return f"got a {type(got).__name__}; expected {want}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"got shape {tuple(got.shape)}; expected {want}"
    if not (got.is_floating_point() or got.is_complex()):
        return f"got dtype {got.dtype}; expected a floating-point tensor like the inputs"
    got = got.detach().to(device=expected.device, dtype=expected.dtype)
    bad_value = ~torch.isfinite(got) & torch.isfinite(expected)
    wrong = ~torch.isclose(got, expected, atol=atol, rtol=rtol) | bad_value
    if not wrong.any():
        return None
    first = [int(i) for i in torch.nonzero(wrong)[0]]
    e, g = expected[tuple(first)].item(), got[tuple(first)].item()
    lines = [f"first difference at {_where(first, dims)}: expected {e:.4f}, got {g:.4f}"]
    if bad_value.any():
        lines[0] += " (not a finite number: a softmax over scores that are all -inf gives nan)"
    per_axis = []
    for axis, name in enumerate(dims[:-1] if len(dims) > 1 else dims):  # which dims of a vector: rarely telling
        other = [a for a in range(wrong.dim()) if a != axis]
        hit = wrong.any(dim=tuple(other)) if other else wrong
        per_axis.append(f"{name} {_index_list(torch.nonzero(hit).flatten().tolist(), wrong.shape[axis])}")
    finite = torch.isfinite(got)
    err = (got - expected).abs()[finite].max().item() if finite.any() else float("nan")
    lines.append(f"wrong at {'; '.join(per_axis)} ({int(wrong.sum())} of {wrong.numel()} numbers, "
                 f"max abs error {err:.3g})")
    return "\n".join(lines)


def fail(case: str, what: str, explanation: str, hint: str | None = None) -> None:
    """Raise the AssertionError a checker shows the learner: which case, what differs, why maybe."""
    msg = f"{case}\n{what}:\n{explanation}"
    if hint:
        msg += f"\nhint: {hint}"
    raise AssertionError(msg)


def passed(num_cases: int, what: str) -> None:
    print(f"all {num_cases} cases passed: {what}")
