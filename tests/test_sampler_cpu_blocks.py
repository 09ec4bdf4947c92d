"""The CPU's top-p paths draw the sorted path's token (`_sample_nucleus`, the reference) on random and
edge-case rows: the C path (minikv/engine/cpu_topp.c, compiled on first use) and the block search in torch
ops (candidates from block maxima, `_sample_nucleus_cpu`), which also reads a row of logits a bounded
number of times, with no int64 or float64 temporary of a row's size. tests/test_cpu_topp.py tests what is
the C path's own."""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minikv.engine.sampler as sampler
from minikv import SamplingParams
from minikv.engine import cpu_topp
from minikv.engine.sampler import draw_keys, sample

VOCAB = 20_011  # past MIN_BLOCKED_VOCAB, and not a multiple of the block: the last block is short


@contextlib.contextmanager
def reference_path():
    saved = sampler.CPU_TOP_P
    sampler.CPU_TOP_P = "sorted"
    try:
        yield
    finally:
        sampler.CPU_TOP_P = saved


@pytest.fixture(params=["c", "blocks"])
def path(request, monkeypatch):
    """Each CPU top-p path in turn (the C one where this machine can build it)."""
    if request.param == "c" and cpu_topp.library() is None:
        pytest.skip(f"the C path cannot be built here: {cpu_topp.why_not()}")
    monkeypatch.setattr(sampler, "CPU_TOP_P", request.param)
    return request.param


@pytest.fixture
def blocks(monkeypatch):
    """The block search in torch ops, whatever "auto" would take."""
    monkeypatch.setattr(sampler, "CPU_TOP_P", "blocks")


def both(logits, params, position=0):
    keys = draw_keys([p.seed or 0 for p in params], [position] * len(params))
    with reference_path():
        want = sample(logits, params, keys)
    return sample(logits, params, keys), want


def model_like(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 0.5, 1.0, 2.0, 4.0]).repeat(rows // 5 + 1)[:rows, None]
    logits = torch.randn(rows, vocab, generator=g) * scale
    ids = torch.randint(0, vocab, (rows, 30), generator=g)
    return logits.scatter_(1, ids, torch.randn(rows, 30, generator=g).abs() * 4 + 6 * scale)


@pytest.mark.parametrize("threads", [1, 2])
def test_top_p_paths_draw_the_sorted_paths_token_on_model_like_rows(threads, path):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = model_like(40, VOCAB, seed=threads)
        params = [SamplingParams(temperature=(0.6, 1.0, 0.25, 1.7)[i % 4], top_p=(0.95, 0.5, 0.99, 0.05, 0.8)[i % 5],
                                 seed=i) for i in range(40)]
        for position in range(3):
            got, want = both(logits, params, position)
            assert got == want
    finally:
        torch.set_num_threads(saved)


def test_top_p_paths_match_on_edge_cases(path):
    """Ties at the nucleus' edge (bf16-like logits and whole rows of one value), a flat row whose nucleus
    is most of the vocabulary, top_p 1 and top-k rows beside top-p rows, a tiny temperature, -inf logits,
    greedy rows, and rows given out of order."""
    g = torch.Generator().manual_seed(7)
    rows = [
        torch.zeros(VOCAB),  # all tied: the nucleus is decided by the order of ties
        (torch.randn(VOCAB, generator=g) * 3).to(torch.bfloat16).float(),  # many ties
        torch.randn(VOCAB, generator=g) * 0.01,  # flat: nucleus past 1,024
        torch.randn(VOCAB, generator=g) * 5,
        torch.randn(VOCAB, generator=g).masked_fill(torch.rand(VOCAB, generator=g) < 0.9, float("-inf")),
        torch.full((VOCAB,), float("-inf")).index_fill(0, torch.tensor([3, 9000, 20_010]), 1.0),  # 3-way tie
    ]
    logits = torch.stack(rows * 2)
    params = [SamplingParams(temperature=0.6, top_p=0.95, seed=1), SamplingParams(temperature=1.0, top_p=0.5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=1e-5, top_p=0.9, seed=4),
              SamplingParams(temperature=0.8, top_p=0.7, seed=5), SamplingParams(temperature=1.0, top_p=0.5, seed=6),
              SamplingParams(temperature=0.6, top_p=1.0, seed=7), SamplingParams(temperature=0.6, top_k=20, seed=8),
              SamplingParams(), SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=9),
              SamplingParams(temperature=2.0, top_p=0.999, seed=10),
              SamplingParams(temperature=0.3, top_p=0.6, seed=11)]
    for position in range(4):
        got, want = both(logits, params, position)
        assert got == want
    order = [5, 0, 11, 3, 8, 1]
    got, want = both(logits[order], [params[i] for i in order], 2)
    assert got == want


@pytest.mark.parametrize("threads", [1, 2])
def test_log_sum_exp_is_torchs_to_1e_5_and_its_bits_where_the_maximum_is_taken_off(threads, blocks):
    """Where exp(x / T) is safe (the largest x / T within 60 of 0), the pass sums exp2(x / (T ln 2)): the
    log-sum-exp is torch's to 1e-5, far inside the search's slack (1e-4 of the mass). Where x / T is
    large (T = 0.05, T = 1e-5), the maximum is taken off first, as torch does: its bits, since an ulp of
    a large log-sum-exp is a large error in the mass."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(5, 151_936, generator=g) * 4
        t = torch.tensor([0.6, 1.0, 0.05, 2.0, 1e-5])
        for rows in ([0, 1, 2, 3, 4], [3, 1], [4], [0, 3]):
            lse = sampler._lse_and_block_max(x, rows, t[rows])[0][:, 0]
            scaled = x[rows] / t[rows, None]
            want = torch.logsumexp(scaled, dim=-1)
            large = scaled.amax(-1).abs() > 60
            assert torch.equal(lse[large], want[large])
            assert ((lse - want).abs()[~large] <= 1e-5).all(), (lse - want)[~large]
            assert (~large).any() or rows == [4]
    finally:
        torch.set_num_threads(saved)


class RowReads(TorchDispatchMode):
    """Counts the elements each op reads or writes in tensors of at least a row's size (views and
    index lookups excluded: they touch what they return), and the dtypes of those it creates."""
    SKIP = {"view", "_unsafe_view", "slice", "select", "alias", "as_strided", "index", "gather",
            "expand", "unsqueeze", "squeeze", "detach", "t", "unbind", "split", "lift_fresh", "_to_copy", "empty",
            "take"}

    def __init__(self, row: int):
        super().__init__()
        self.row, self.elements, self.big_dtypes = row, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in self.SKIP:
            given = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
            self.elements += sum(a.numel() for a in given if a.numel() >= self.row)
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.numel() >= self.row:
                    self.big_dtypes.add(o.dtype)
                    if not any(o is a for a in given):  # a new tensor: written
                        self.elements += o.numel()
        return out


def test_sampled_rows_read_the_vocabulary_a_bounded_number_of_times(blocks):
    """Greedy reads each row once (its max). A top-p row the block search draws costs six row-sized reads
    or writes, all float32: the block maxima, x / T (read x, write a buffer of a few rows), - m and exp in
    place, sum. The candidates are gathered by index, a few per block. (The sorted path: six or more,
    its top-k of the whole row reading as one.)"""
    rows, vocab = 8, 151_936  # 8 rows: the block maxima, 8 x 9,496, stay under a row's size
    logits = model_like(rows, vocab, seed=5)
    logits[:, 17] += 30  # peaked rows: the nucleus is found among the first candidates
    params = [SamplingParams(temperature=0.6, top_p=0.95, seed=i) for i in range(rows)]
    keys = draw_keys(list(range(rows)), [0] * rows)
    with RowReads(vocab) as greedy:
        sample(logits, [SamplingParams()] * rows, keys)
    with RowReads(vocab) as sampled:
        sample(logits, params, keys)
    with reference_path(), RowReads(vocab) as reference:
        sample(logits, params, keys)
    assert greedy.elements == rows * vocab
    assert sampled.elements <= 6 * rows * vocab, sampled.elements / (rows * vocab)
    assert sampled.big_dtypes <= {torch.float32}, sampled.big_dtypes
    assert reference.elements >= 6 * rows * vocab


def heavy_tailed(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows whose nucleus at T = 0.6, top-p 0.95 holds thousands of tokens: a normal tail N(0, 2^2) over a
    vocabulary of Qwen2.5's size, under a weak head of 40 tokens (logit 9.5 - 0.5 ln(rank))."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    head = 9.5 - 0.5 * torch.arange(1, 41, dtype=torch.float32).log()
    ids = torch.stack([torch.randperm(vocab, generator=g)[:40] for _ in range(rows)])
    return logits.scatter_(1, ids, head.expand(rows, 40).contiguous())


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_whose_nucleus_holds_thousands_of_tokens_draw_the_sorted_paths_token_without_its_sort(
        threads, path, monkeypatch):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, vocab = 6, 151_936
        logits = heavy_tailed(rows, vocab, seed=threads)
        params = [SamplingParams(temperature=0.6, top_p=0.95, seed=i) for i in range(rows)]
        assert min(int((sampler.filtered_probs(row, params[0]) > 0).sum()) for row in logits) > 1024
        sorted_rows = []
        sorted_path = sampler._sample_nucleus

        def counting(scaled, *rest):
            sorted_rows.append(scaled.shape[0])
            return sorted_path(scaled, *rest)

        for position in range(3):
            keys = draw_keys(list(range(rows)), [position] * rows)
            with reference_path():
                want = sample(logits, params, keys)
            monkeypatch.setattr(sampler, "_sample_nucleus", counting)
            got = sample(logits, params, keys)
            monkeypatch.setattr(sampler, "_sample_nucleus", sorted_path)
            assert got == want
        assert sum(sorted_rows) <= 1, sorted_rows  # a draw near the nucleus' edge may go there, rarely
    finally:
        torch.set_num_threads(saved)


class Ops(TorchDispatchMode):
    """Counts the ops run, views aside."""
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.__name__.split(".")[0] not in {"view", "_unsafe_view", "slice", "select", "alias",
                                                         "as_strided", "expand", "unsqueeze", "squeeze", "detach"}
        return func(*args, **(kwargs or {}))


def test_a_sampled_step_with_two_threads_runs_no_op_per_row(blocks):
    """With several threads every op over a whole row opens a parallel region, where libgomp's idle
    threads spin and, on a busy machine, the region waits for a core: so the log-sum-exp takes chunks
    of up to 16 rows and the rest of the step works on all rows at once. Four times the rows add the
    ops of three more chunks, fewer than one per row, where a loop over rows would add one or more per
    row."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = heavy_tailed(4, 151_936, seed=3)
        logits[:2, 5] += 25  # two peaked rows beside two whose nucleus holds thousands of tokens
        counts = {}
        for rows in (16, 64):
            params = [SamplingParams(temperature=0.6, top_p=0.95, seed=i % 4) for i in range(rows)]
            keys = draw_keys(list(range(rows)), [0] * rows)
            with Ops() as mode:
                sample(logits.repeat(rows // 4, 1), params, keys)
            counts[rows] = mode.ops
        assert counts[64] - counts[16] < 64 - 16, counts
    finally:
        torch.set_num_threads(saved)


def test_a_row_whose_top_token_alone_holds_top_p_draws_it_without_looking_for_a_nucleus(blocks, monkeypatch):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, VOCAB, generator=g)
    for row, token in enumerate([0, 7_777, VOCAB - 1, VOCAB - 2]):  # the last two in the short last block
        logits[row, token] = 20.0
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(4)]
    drawn = []
    monkeypatch.setattr(sampler, "_draw_above", lambda *args: drawn.append(args) or None)
    got, want = both(logits, params)
    assert got == want == [0, 7_777, VOCAB - 1, VOCAB - 2]
    assert not drawn
