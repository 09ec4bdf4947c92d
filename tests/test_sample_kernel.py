"""The GPU sampling kernel (minikv/kernels/sample.py: on a GPU where there is one, otherwise in Triton's
interpreter) draws the same token as the torch sampler on the CPU, row for row: temperature alone, top-p on
peaked and flat rows, ties."""
import pytest
import torch

import minikv.engine.sampler as sampler
from minikv import SamplingParams
from minikv.engine.sampler import draw_key, filtered_probs, sample
from minikv.kernels.sample import sample_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernel runs (tests/conftest.py: the interpreter)


def draws(params: list[SamplingParams], keys: list[int], rows: list[int] | None = None) -> torch.Tensor:
    """The packed settings the kernel reads: a draw for each of `rows` (default: every row, in order)."""
    return sampler.pack_draws(params, keys, list(range(len(params))) if rows is None else rows).to(DEV)


def rows_of_every_shape(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked, moderate and nearly flat rows: a flat row's nucleus holds most of the vocabulary, and
    the kernel pivots several times before its draw lands inside it."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01, 0.5, 2.0, 6.0]).repeat(n // 4 + 1)[:n, None]
    return torch.randn(n, vocab, generator=g) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_draws_the_torch_samplers_token(dtype):
    n, vocab = 48, 3000
    logits = rows_of_every_shape(n, vocab, seed=0).to(dtype)
    params = [SamplingParams(temperature=(0.6, 1.0, 1.7)[i % 3], top_p=(1.0, 0.95, 0.5, 0.05)[i % 4])
              for i in range(n)]
    keys = [draw_key(i, 11) for i in range(n)]
    want = sample(logits.float(), params, keys)
    got = sample_rows(logits.to(DEV), draws(params, keys)).tolist()
    assert got == want


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_kernel_on_a_row_of_ties_keeps_the_lowest_ids_in_the_nucleus():
    """All logits equal: the nucleus of top_p 0.45 is the first 450 tokens by id, as `filtered_probs`'s
    stable sort orders ties. (Not 0.5: a mass landing on top_p exactly is decided by rounding. The CPU
    path's partial top-k may order ties otherwise: an equally valid nucleus, but another one.)"""
    n, vocab = 300, 1000
    params, keys = [SamplingParams(temperature=1.0, top_p=0.45)] * n, [draw_key(s, 0) for s in range(n)]
    got = sample_rows(torch.zeros(n, vocab, device=DEV), draws(params, keys)).tolist()
    allowed = (filtered_probs(torch.zeros(vocab), params[0]) > 0).nonzero()[:, 0].tolist()
    assert allowed == list(range(450))
    assert max(got) < 450 and len(set(got)) > 200  # spread over the nucleus


def test_kernel_reads_only_the_rows_it_is_given():
    logits = rows_of_every_shape(8, 500, seed=1)
    params, keys = [SamplingParams(temperature=0.8, top_p=0.9)] * 8, [draw_key(7, r) for r in range(8)]
    rows = [6, 1, 3]
    got = sample_rows(logits.to(DEV), draws(params, keys, rows)).tolist()
    assert got == sample(logits[rows], params[:3], [keys[r] for r in rows])


def test_the_engines_sampler_through_the_kernel_matches_the_cpu_path(monkeypatch):
    """sample_on_device sends a GPU's temperature and top-p rows to the kernel, top-k rows to torch;
    forced onto the kernel here, a mixed batch gives the CPU path's tokens."""
    n = 24
    logits = rows_of_every_shape(n, 800, seed=2)
    params = [SamplingParams() if i % 5 == 0 else
              SamplingParams(temperature=0.7, top_k=(0, 0, 20)[i % 3], top_p=(1.0, 0.9)[i % 2]) for i in range(n)]
    keys = [draw_key(i, 3) for i in range(n)]
    want = sample(logits, params, keys)
    monkeypatch.setattr(sampler, "_use_kernel", lambda dev: True)
    assert sampler.sample_on_device(logits.to(DEV), params, keys).tolist() == want


def test_kernel_refuses_a_bad_layout():
    logits = torch.zeros(4, 100, device=DEV)
    with pytest.raises(ValueError, match="contiguous rows"):
        sample_rows(logits.t(), draws([SamplingParams(temperature=1.0)] * 2, [1, 2]))
    with pytest.raises(ValueError, match=r"\[draws, 5\] int64"):
        sample_rows(logits, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="one device"):
        sample_rows(logits, torch.zeros(2, 5, dtype=torch.long, device="meta"))
