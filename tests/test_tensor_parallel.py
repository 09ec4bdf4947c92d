"""Rung 12: tensor parallelism over torch.distributed (gloo on the CPU), minikv/engine/parallel.py.

"Equal" means the same greedy token ids. The all-reduce sums the ranks' partial o_proj and down_proj
outputs in another order than one matmul does, so the float32 logits may differ in their last bits;
a token changes only where two logits are that close, and on the ladder's prompts none is (the
test on SmolLM2 below pins it). Each engine here starts worker processes (seconds each): the
SmolLM2 engines are shared by the tests of one size, and the fault tests use tiny-random.
"""
import os
import signal
import time

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.parallel import TensorParallelError
from minikv.model.tensor_parallel import HeadShard, shard_all, shard_heads

from test_serve import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "KV caching speeds up decoding because"]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TIMEOUT = 10  # seconds an all-reduce waits for a silent rank (a step of these engines takes far less, even busy)
SMALL_POOL = dict(kv_backend="paged", device="cpu", dtype="float32", num_blocks=48, block_size=16, max_model_len=256)


def test_shard_heads_replicates_a_kv_head_that_straddles_two_ranks():
    # SmolLM2: 9 query heads in 3 groups of 3; two ranks cannot split 3 K/V heads, so K/V head 1 is on both
    assert shard_heads(9, 3, 2, 0) == HeadShard((0, 1), (0, 1, 2, 3, 4, None))
    assert shard_heads(9, 3, 2, 1) == HeadShard((1, 2), (None, None, 5, 6, 7, 8))
    assert [s.kv_heads for s in shard_all(9, 3, 3)] == [(0,), (1,), (2,)]  # 3 divides 3: no replication


@pytest.mark.parametrize("heads,kv,n", [(9, 3, 2), (9, 3, 3), (4, 2, 3), (32, 8, 3), (64, 8, 16), (32, 32, 4)])
def test_every_query_head_runs_on_one_rank_and_every_pool_has_the_same_heads(heads, kv, n):
    shards = shard_all(heads, kv, n)  # checks both, and each slot's head reads its own K/V head
    assert len({len(s.kv_heads) for s in shards}) == 1
    assert len(shards[0].kv_heads) == max(-(-kv // n), 1) or (heads, kv, n) == (32, 8, 3)  # 8 heads on 3 ranks: 4


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, kv_backend="contiguous"), "use kv_backend='paged'"),
    (dict(tensor_parallel_size=2, kv_backend="paged", preemption="swap"), "preemption='swap' does not run under"),
    (dict(tensor_parallel_size=2, kv_backend="paged", kv_cache_dtype="int8"), "does not run under tensor"),
    (dict(tensor_parallel_size=2, tensor_parallel_timeout=0), "tensor_parallel_timeout must be"),
    (dict(tensor_parallel_size=5), "exceeds the model's 4 attention heads"),
    (dict(tensor_parallel_sise=2), "did you mean 'tensor_parallel_size'"),
])
def test_bad_tensor_parallel_options_are_refused_before_any_worker_starts(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM("tiny-random", device="cpu", **options)


def test_serve_refuses_a_bad_tensor_parallel_size_before_it_listens(capsys):
    from minikv.cli import main

    assert main(["serve", "--model", "tiny-random", "--device", "cpu", "--port", "0", "--no-engine-process",
                 "--tensor-parallel-size", "0"]) != 0
    assert "tensor_parallel_size must be an integer >= 1" in capsys.readouterr().err


def _prefix_hits_and_preemptions(**options):
    """Two calls sharing a 13-token prefix (the second hits the cache), six requests in a pool of 24 blocks
    of 4 (some are preempted and recomputed), and n=2 sampled forks (copy-on-write)."""
    opts = dict(device="cpu", kv_backend="paged", block_size=4, num_blocks=24, prefix_caching="hash",
                max_model_len=64, max_num_seqs=8, **options)
    with LLM("tiny-random", **opts) as llm:
        shared = list(range(1, 14))
        first = llm.generate([shared + [20]], SamplingParams(max_tokens=20, ignore_eos=True))
        rest = llm.generate([shared + [30 + i] for i in range(6)], SamplingParams(max_tokens=20, ignore_eos=True))
        forks = llm.generate([shared + [50]], SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=3,
                                                              ignore_eos=True))
        s = llm.stats()
        tokens = [o.token_ids for o in first + rest] + [c.token_ids for c in forks[0].outputs]
        return tokens, s["prefix_cache"]["hits"], s["num_preemptions"], s["cow_copies"]


def test_prefix_caching_preemption_and_forks_run_under_tensor_parallelism():
    one, two = _prefix_hits_and_preemptions(), _prefix_hits_and_preemptions(tensor_parallel_size=2)
    assert one[1] > 0 and one[2] > 0 and one[3] > 0  # the workload hits, preempts and copies on write
    assert two == one  # the same tokens, hits, preemptions and copies: rank 0 decides, every rank follows


@pytest.fixture(scope="module")
def reference():
    """TP = 1: the tokens, and the bytes of K/V per token of the whole model."""
    with LLM("smollm2-135m", **SMALL_POOL) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.stats()["bytes_per_token"]


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def tp(request, smollm2_dir):
    """SmolLM2 on N ranks (one group per process: pytest ends the TP=2 engine before the TP=3 one starts)."""
    with LLM("smollm2-135m", tensor_parallel_size=request.param, tensor_parallel_timeout=TIMEOUT, **SMALL_POOL) as llm:
        yield request.param, llm


@pytest.mark.slow  # SmolLM2 on 2 and 3 processes
def test_tensor_parallel_greedy_tokens_equal_one_process(tp, reference):
    n, llm = tp
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference[0]


@pytest.mark.slow  # SmolLM2 on 2 and 3 processes
def test_each_rank_pool_holds_its_share_of_the_kv_heads(tp, reference):
    n, llm = tp
    ranks = llm.stats()["tensor_parallel"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(n))
    assert len({r["pid"] for r in ranks}) == n  # one process each
    share = {2: 2, 3: 1}[n]  # K/V heads per rank out of SmolLM2's 3: TP=2 replicates one head
    for r in ranks:
        assert r["num_kv_heads"] == share and r["num_blocks"] == 48
        assert r["bytes_per_token"] * 3 == reference[1] * share  # 2/3 of the model's bytes at TP=2, 1/3 at TP=3
    assert sorted(h for r in ranks for h in r["q_heads"]) == list(range(9))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow  # SmolLM2 on 2 and 3 processes
def test_a_killed_or_hung_worker_fails_the_engine_within_the_timeout(tp):
    """Last for each engine (it ends it): TP=2 loses a worker to SIGKILL, TP=3 has one stopped (SIGSTOP)."""
    n, llm = tp
    worker = llm.stats()["tensor_parallel"]["ranks"][-1]["pid"]
    start = time.monotonic()
    try:
        os.kill(worker, signal.SIGKILL if n == 2 else signal.SIGSTOP)
        with pytest.raises(TensorParallelError, match="rank.*build a new LLM"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < TIMEOUT + 60  # bounded: the timeout, with room for a busy machine
        wait_until(lambda: _gone(worker), f"worker {worker} ended (the stopped one too)", timeout_s=30.0, poll_s=0.05)
        with pytest.raises(TensorParallelError, match="failed"):  # and every later step fails at once
            llm.generate(PROMPTS[:1], GREEDY)
        assert llm.stats()["tensor_parallel"]["alive"] is False
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
