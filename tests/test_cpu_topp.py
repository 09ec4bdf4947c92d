"""The C path of the CPU's top-p draws (minikv/engine/cpu_topp.c through cpu_topp.py): the sorted path's
token on every row it is sure of, and sure of most rows; not sure where it must not be (a logit that is not
finite, a log-sum-exp so large that an ulp of it passes the slack, top_p within the slack of 1); the same
tokens with any number of workers; a clear error for input it cannot read; and, without a compiler, the
torch path in its place."""
import subprocess
import sys

import pytest
import torch

import minikv.engine.sampler as sampler
from minikv import SamplingParams
from minikv.engine import cpu_topp
from minikv.engine.sampler import _mass_slack, _sample_nucleus, draw_keys, sample

from test_sampler_cpu_blocks import model_like  # (tests/ is on the path) a normal tail at five scales, a head of 30

needs_c = pytest.mark.skipif(cpu_topp.library() is None, reason=f"no C path here: {cpu_topp.why_not()}")


def c_draws(logits, temperature, top_p, position=0, threads=1):
    n = logits.shape[0]
    key = torch.from_numpy(draw_keys(list(range(n)), [position] * n))
    t, p = torch.full((n,), temperature), torch.full((n,), top_p)
    choice, sure = cpu_topp.top_p_rows(logits, torch.arange(n), t, key, p, _mass_slack(logits.shape[-1]), threads)
    want = _sample_nucleus(logits / t[:, None], key, p)
    return choice, sure, want


@needs_c
@pytest.mark.parametrize("vocab", [16, 17, 100, 1_000, 20_011, 151_936])
def test_sure_rows_are_the_sorted_paths_token_and_most_rows_are_sure(vocab):
    rows = 40 if vocab < 100_000 else 10
    logits = model_like(rows, vocab, seed=vocab)
    sure_rows = 0
    for temperature, top_p in [(0.6, 0.95), (1.0, 0.5), (0.25, 0.99), (1.7, 0.05), (2.0, 0.8)]:
        for position in range(2):
            choice, sure, want = c_draws(logits, temperature, top_p, position)
            assert torch.equal(choice[sure], want[sure]), (temperature, top_p, position)
            sure_rows += int(sure.sum())
    assert sure_rows >= 0.9 * rows * 10, sure_rows  # a test of the C path, not of the fallback


@needs_c
def test_ties_decide_by_the_lower_id_and_low_top_p_keeps_one_of_them():
    """Tied logits, as bf16 rounds them, and a two-way tie at the top with top_p below a half: the sorted
    path's nucleus is the lower id alone. Distinct logits that x / T rounds to one float tie too."""
    g = torch.Generator().manual_seed(5)
    rows = [(torch.randn(5_000, generator=g) * 3).to(torch.bfloat16).float(), torch.zeros(5_000),
            torch.randn(5_000, generator=g).index_fill(0, torch.tensor([4_000, 17]), 9.0)]
    logits = torch.stack(rows)
    for temperature, top_p in [(0.6, 0.95), (1.0, 0.3), (1.0, 0.45), (3.0, 0.9)]:
        for position in range(4):
            choice, sure, want = c_draws(logits, temperature, top_p, position)
            assert torch.equal(choice[sure], want[sure])
    choice, sure, _ = c_draws(logits[2:], 1.0, 0.3)
    assert sure.all() and choice.tolist() == [17]
    a = torch.tensor(1.5078479051589966)
    x = torch.stack([a, torch.nextafter(a, torch.tensor(2.0))]).repeat(8)  # distinct floats, one quotient at T = 3
    assert x[0] != x[1] and torch.equal(x[0] / 3.0, x[1] / 3.0)
    logits = torch.nn.functional.pad(x, (0, 40), value=-30.0)[None, :].repeat(3, 1)
    for top_p in (0.05, 0.5, 0.9):
        choice, sure, want = c_draws(logits, 3.0, top_p)
        assert torch.equal(choice[sure], want[sure]) and sure.any()


@needs_c
def test_not_sure_of_rows_it_must_leave_to_the_sorted_path():
    vocab = 2_000
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, vocab, generator=g)
    x[0, 5] = float("nan")
    x[1, 6] = float("inf")
    x[2] = float("-inf")
    x[3] = x[3] * 3  # at T = 1e-4 its log-sum-exp is ~1e5: an ulp of it, 0.008, is a mass top_p 0.99 cannot spare
    x[4, 9] = 50.0  # peaked: sure even at top_p 0.999
    key = torch.from_numpy(draw_keys(list(range(6)), [0] * 6))
    t = torch.tensor([1.0, 1.0, 1.0, 1e-4, 1.0, 1.0])
    p = torch.tensor([0.9, 0.9, 0.9, 0.99, 0.999, 1.0])  # the last: top_p 1 is the whole vocabulary
    choice, sure = cpu_topp.top_p_rows(x, torch.arange(6), t, key, p, _mass_slack(vocab))
    assert sure.tolist() == [False, False, False, False, True, False]
    assert choice[4] == 9
    # the sampler hands those rows to the sorted path: the same tokens as the reference, NaN row included
    params = [SamplingParams(temperature=float(t[i]), top_p=float(p[i]), seed=i) for i in range(6)]
    keys = draw_keys(list(range(6)), [0] * 6)
    saved = sampler.CPU_TOP_P
    try:
        sampler.CPU_TOP_P = "sorted"
        want = sample(x, params, keys)
        sampler.CPU_TOP_P = "c"
        assert sample(x, params, keys) == want
    finally:
        sampler.CPU_TOP_P = saved


@needs_c
def test_any_number_of_workers_draws_the_same_tokens():
    logits = model_like(23, 20_011, seed=9)
    base = c_draws(logits, 0.6, 0.95, threads=1)
    for threads in (2, 3, 8, 64, 100):
        choice, sure, _ = c_draws(logits, 0.6, 0.95, threads=threads)
        assert torch.equal(sure, base[1]) and torch.equal(choice[sure], base[0][sure])


@needs_c
def test_rows_given_out_of_order_from_a_larger_batch_and_a_strided_batch():
    logits = model_like(12, 3_001, seed=4)
    rows = torch.tensor([7, 0, 11, 3])
    key = torch.from_numpy(draw_keys([1, 2, 3, 4], [0] * 4))
    t, p = torch.tensor([0.6, 1.0, 0.3, 2.0]), torch.tensor([0.95, 0.5, 0.9, 0.7])
    choice, sure = cpu_topp.top_p_rows(logits, rows, t, key, p, _mass_slack(3_001))
    want = _sample_nucleus(logits[rows] / t[:, None], key, p)
    assert sure.any() and torch.equal(choice[sure], want[sure])
    wide = torch.zeros(12, 4_000)
    wide[:, :3_001] = logits
    choice2, sure2 = cpu_topp.top_p_rows(wide[:, :3_001], rows, t, key, p, _mass_slack(3_001))
    assert torch.equal(sure2, sure) and torch.equal(choice2[sure], choice[sure])


@needs_c
def test_input_it_cannot_read_gets_a_clear_error():
    x = torch.randn(2, 100)
    args = (torch.tensor([0.6, 0.6]), torch.tensor([1, 2]), torch.tensor([0.9, 0.9]), 1e-4)
    with pytest.raises(ValueError, match="float32 CPU logits"):
        cpu_topp.top_p_rows(x.half(), torch.arange(2), *args)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_topp.top_p_rows(x.t().contiguous().t(), torch.arange(2), *args)
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        cpu_topp.top_p_rows(x[0], torch.arange(1), *[a[:1] if isinstance(a, torch.Tensor) else a for a in args])
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 2\)"):
        cpu_topp.top_p_rows(x, torch.tensor([0, 2]), *args)
    with pytest.raises(ValueError, match="one per row"):
        cpu_topp.top_p_rows(x, torch.arange(2), torch.tensor([0.6]), *args[1:])


def test_without_a_compiler_the_torch_path_samples_and_asking_for_c_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setattr(cpu_topp, "_state", {})
    monkeypatch.setattr(cpu_topp, "_compiler", lambda: None)
    assert cpu_topp.library() is None and "no C compiler" in cpu_topp.why_not()
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(cpu_topp, "_state", {})
    monkeypatch.setattr(cpu_topp, "_compiler", lambda: "/usr/bin/cc")
    assert cpu_topp.library() is None and "point MINIKV_CACHE at a folder you can write" in cpu_topp.why_not()
    monkeypatch.setattr(cpu_topp, "_state", {})
    monkeypatch.setattr(cpu_topp, "_compiler", lambda: None)
    assert cpu_topp.library() is None
    logits = model_like(4, 20_011, seed=1)
    params = [SamplingParams(temperature=0.6, top_p=0.95, seed=i) for i in range(4)]
    keys = draw_keys(list(range(4)), [0] * 4)
    assert sampler._cpu_top_p_path(logits) == "blocks"
    got = sample(logits, params, keys)
    monkeypatch.setattr(sampler, "CPU_TOP_P", "sorted")
    assert got == sample(logits, params, keys)
    monkeypatch.setattr(sampler, "CPU_TOP_P", "c")
    with pytest.raises(RuntimeError, match="no C compiler"):
        sample(logits, params, keys)


@needs_c
def test_the_library_is_built_once_per_source_and_machine_then_loaded(tmp_path):
    """A fresh process with an empty cache folder builds it; the next loads it without a compiler."""
    code = ("from minikv.engine import cpu_topp; import sys; "
            "print(cpu_topp.library() is not None, cpu_topp.why_not(), sorted(p.name for p in "
            "__import__('pathlib').Path(sys.argv[1], 'build').iterdir()))")
    env = {"MINIKV_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           env=env | {"CC": cpu_topp._compiler()})
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("True None ['cpu_topp-") and first.stdout.count(".so") == 1
    second = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                            env=env | {"PATH": str(tmp_path)})  # no compiler on PATH: the cached library
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    off = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env=env | {"MINIKV_CPU_TOPP": "torch"})
    assert off.stdout.startswith("False MINIKV_CPU_TOPP=torch")


@needs_c
def test_rows_mostly_minus_infinity_are_drawn_and_a_nan_anywhere_is_not_sure():
    """A row read a segment at a time (16 segments of vocab // 16 ids, and the tail): segments that hold
    only -inf add nothing, wherever they lie; a NaN in a segment of -inf still leaves the row to the sorted
    path."""
    vocab = 16 * 500 + 7
    x = torch.full((4, vocab), float("-inf"))
    x[0, [3, 4_200, vocab - 1]] = torch.tensor([1.0, 2.0, 1.5])  # three finite tokens, the last in the tail
    x[1, 7_999] = 0.0  # one finite token: it is the draw
    x[2, 10] = 2.0
    x[2, 700] = float("nan")  # a segment of -inf and a NaN, after a finite one
    x[3, [7_000, 7_001]] = 3.0
    x[3, 1_200] = float("nan")  # before the first finite segment
    choice, sure, want = c_draws(x, 1.0, 0.9)
    assert sure.tolist() == [True, True, False, False]
    assert torch.equal(choice[:2], want[:2]) and choice[1] == 7_999
