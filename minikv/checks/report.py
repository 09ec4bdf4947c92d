"""Explain the FIRST way a learner's tensor differs from the reference, in words a learner can act on.

    first_difference(expected, got, dims=("position", "head", "dim"))
    -> None when they match, else e.g.

    first difference at position 2, head 1, dim 0: expected 0.4180, got -0.1212
    wrong at position 1, 2, 3 of 0..3; head 1, 3 of 0..3 (12 of 64 numbers, max abs error 0.91)

Listing which indexes along each axis are wrong is what points at the bug: a mask bug leaves
position 0 right, a head-grouping bug leaves head 0 right, a missing scale touches everything.

A failing check raises CheckFailed (an AssertionError: pytest and nbval's `raises-exception` see what
they always saw). In a notebook the learner reads the diagnosis alone, not twenty lines of traceback
through minikv/checks/: importing this module in an IPython kernel registers a display for check
failures and unfinished stubs (`short_report`). `%tb` prints the full traceback of the last error,
and `minikv.checks.report.SHOW_TRACEBACK = True` shows every traceback whole again.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Sequence

import torch

SHOW_TRACEBACK = False  # True: check failures show their whole traceback, as any other error does
CHECKS_DIR = Path(__file__).resolve().parent


class CheckFailed(AssertionError):
    """A checker's verdict. The message is the whole diagnosis: which case, what differs, expected vs
    got, a hint; the traceback (through the checker) adds nothing a learner can act on."""


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
    """Raise the CheckFailed a checker shows the learner: which case, what differs, why maybe."""
    msg = f"{case}\n{what}:\n{explanation}"
    if hint:
        msg += f"\nhint: {hint}"
    raise CheckFailed(msg)


def passed(num_cases: int, what: str) -> None:
    print(f"all {num_cases} cases passed: {what}")


# ---- what a learner reads when a check cell fails --------------------------------------------------

def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def cell_label(filename: str) -> str | None:
    """'Cell In[4]' for a notebook cell's code (or 'cell 4' as `minikv check` names them), None for a file."""
    shell = _shell()
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda name: None)(filename)
    if named:
        return " ".join(named)
    if filename.startswith("<cell ") and filename.endswith(">"):
        return filename[1:-1]
    return None


def _in_checks(filename: str) -> bool:
    try:
        return Path(filename).resolve().is_relative_to(CHECKS_DIR)
    except (OSError, ValueError):
        return False


def _learner_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(exc.__traceback__) if cell_label(f.filename)]


def _code_place(frame: traceback.FrameSummary) -> str:
    at = f"{cell_label(frame.filename)}, line {frame.lineno}"
    return at if frame.name == "<module>" else f"{frame.name} ({at})"


def short_report(exc: BaseException) -> str | None:
    """The diagnosis of a failed check, to show instead of a traceback; None for any other error.

    CheckFailed, or an AssertionError a checker raised    ->  its message
    NotImplementedError from a stub (or a checker)        ->  its message, and which function is still a stub
    anything else (a bug in the learner's code, in torch) ->  None: the traceback is the useful part
    """
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    name = type(exc).__name__
    if isinstance(exc, CheckFailed) or (isinstance(exc, AssertionError) and _in_checks(raised_in)):
        return f"{name}: {exc}"
    if isinstance(exc, NotImplementedError) and (cell_label(raised_in) or _in_checks(raised_in)):
        text = f"{name}: {exc}"
        if cell_label(raised_in):
            text += f"\n{_code_place(frames[-1])} is still a stub: write its body, run its cell, then the check again"
        return text
    return None


def explain(exc: BaseException) -> str:
    """short_report, or else the error and the line of the learner's code it came from (for `minikv check`)."""
    report = short_report(exc)
    if report is not None:
        return report
    text = f"{type(exc).__name__}: {exc}"
    mine = _learner_frames(exc)
    if mine:
        line = (mine[-1].line or "").strip()
        text += f"\nraised in {_code_place(mine[-1])}" + (f": {line}" if line else "")
    return text


_HIDDEN = ("(the traceback is hidden: %tb shows it; minikv.checks.report.SHOW_TRACEBACK = True "
           "shows every one)")


def _show_check_failure(shell, etype, value, tb, tb_offset=None):
    """IPython's custom exception handler: the diagnosis alone for check failures, else the usual traceback."""
    report = None if SHOW_TRACEBACK else short_report(value)
    if report is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb  # what %tb reads
    if sys.version_info >= (3, 12):
        sys.last_exc = value
    head, _, rest = report.partition(": ")
    stb = [f"\x1b[0;31m{head}\x1b[0m: {rest}", _HIDDEN]
    shell._showtraceback(etype, value, stb)
    return None


def install_notebook_display() -> bool:
    """In an IPython kernel, show check failures as their diagnosis; never over another library's handler."""
    shell = _shell()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    handled = (AssertionError, NotImplementedError)
    if shell.custom_exceptions not in ((), handled):
        return False
    shell.set_custom_exc(handled, _show_check_failure)
    return True


install_notebook_display()
