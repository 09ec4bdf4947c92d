"""The batched sampler draws from the right distribution, never leaves the top-k / top-p set, keeps
greedy rows exact, and gives a row the same token whatever else is in the batch."""
import torch

from minikv import SamplingParams
from minikv.engine.sampler import (
    MASK64,
    draw_key,
    draw_keys,
    filtered_probs,
    sample,
    splitmix64,
    uniform_noise,
    unit_float,
)

N = 20000  # draws per distribution: the frequency of a token is within 4 sigma (~0.014) of its probability


def frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    tokens = sample(logits.expand(N, -1), [params] * N, [draw_key(seed, 0) for seed in range(N)])
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / N


def test_frequencies_match_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for t in (0.5, 1.0, 2.0):
        want = torch.softmax(logits / t, dim=-1)
        got = frequencies(logits[None], SamplingParams(temperature=t))
        assert (got - want).abs().max() < 0.014, (t, got, want)


def test_frequencies_match_the_renormalised_top_k_and_top_p_sets():
    logits = torch.tensor([1.5, 1.4, 1.0, 0.2, 0.1, -0.5, -2.0])
    for params in (SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.8),
                   SamplingParams(temperature=1.3, top_k=5, top_p=0.9)):
        want = filtered_probs(logits, params)
        got = frequencies(logits[None], params)
        assert (got - want).abs().max() < 0.014, (params, got, want)
        assert got[want == 0].sum() == 0  # never outside the set


def test_top_k_and_top_p_never_leave_their_sets_on_random_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 50, generator=g) * 3
    params = [SamplingParams(temperature=0.5 + (i % 4) * 0.5, top_k=i % 7, top_p=(1.0, 0.9, 0.5, 0.2)[i % 4])
              for i in range(512)]
    tokens = sample(logits, params, [draw_key(i, 3) for i in range(512)])
    for row, (tok, p) in enumerate(zip(tokens, params)):
        assert filtered_probs(logits[row], p)[tok] > 0, (row, p)


def test_greedy_rows_are_exact_argmax_beside_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g)
    params = [SamplingParams() if i % 2 else SamplingParams(temperature=1.0, top_p=0.9) for i in range(64)]
    tokens = sample(logits, params, [draw_key(i, 0) for i in range(64)])
    assert all(tokens[i] == int(logits[i].argmax()) for i in range(1, 64, 2))


def test_greedy_rows_take_the_first_of_tied_maxima_and_a_nan_as_argmax_does():
    """On the CPU greedy rows take torch's max over the vocabulary, not argmax: the same index."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 4, (12, 151_936), generator=g).float()  # every row ties at its maximum
    logits[1, 70_000] = float("nan")
    logits[2, [9, 90_000]] = float("nan")
    logits[3, ::5] = float("inf")
    logits[4] = float("-inf")
    logits[5, 151_935] = 9.0  # the maximum in the last lane
    tokens = sample(logits, [SamplingParams()] * 12, [0] * 12)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[0] == int((logits[0] == 3).nonzero()[0])


def test_a_flat_row_whose_top_p_set_reaches_past_the_candidates_is_drawn_exactly():
    logits = torch.zeros(1, 5000)  # uniform: top_p 0.5 keeps 2,500 tokens, more than the 1,024 candidates
    params = SamplingParams(temperature=1.0, top_p=0.5)
    tokens = sample(logits.expand(4000, -1), [params] * 4000, [draw_key(s, 0) for s in range(4000)])
    allowed = filtered_probs(logits[0], params) > 0
    assert abs(int(allowed.sum()) - 2500) <= 1 and all(allowed[t] for t in tokens)  # float sums: +-1
    assert len(set(tokens)) > 1500  # spread over the whole set, not only the candidates


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 100, generator=g)
    params = [SamplingParams(temperature=0.8, top_k=(0, 10, 40)[i % 3], top_p=(1.0, 0.95)[i % 2]) for i in range(16)]
    keys = [draw_key(100 + i, 7) for i in range(16)]
    together = sample(logits, params, keys)
    alone = [sample(logits[i:i + 1], [params[i]], [keys[i]])[0] for i in range(16)]
    assert together == alone
    shuffled = list(reversed(range(16)))
    assert sample(logits[shuffled], [params[i] for i in shuffled], [keys[i] for i in shuffled]) == together[::-1]


def test_noise_is_the_64_bit_hash_it_claims_to_be():
    """int64 lanes must wrap like uint64 arithmetic: compare with the same hash in Python integers."""
    keys = [draw_key(s, p) for s, p in ((0, 0), (1, 5), (2**62, 9))]
    u = uniform_noise(torch.tensor(keys), torch.arange(1000))
    for row, key in enumerate(keys):
        for vid in (0, 1, 17, 999):
            x = (key ^ (vid * 0x9E3779B97F4A7C15)) & MASK64
            want = ((splitmix64(x) >> 41) + 0.5) / (1 << 23)
            assert abs(float(u[row, vid]) - want) < 1e-7
    assert 0 < float(u.min()) and float(u.max()) < 1


def test_the_extreme_hashes_map_strictly_inside_0_and_1():
    """u = 1 (or 0) would make the Gumbel noise infinite, and that token win whatever its probability."""
    u = unit_float(torch.tensor([-1, 0]))  # a hash with every bit set (int64 -1), and one with none
    assert 0.0 < float(u[1]) < float(u[0]) < 1.0


def test_keys_taken_many_at_once_are_the_keys_taken_one_by_one():
    seeds = [0, 1, 7, 2**62, 2**63 - 1, 123456789]
    positions = [0, 5, 1, 999, 2**20, 3]
    assert draw_keys(seeds, positions).tolist() == [draw_key(s, p) for s, p in zip(seeds, positions)]
