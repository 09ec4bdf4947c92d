"""Checker for exercise 14a: which attention heads each tensor-parallel rank holds.

    shard_heads(num_heads, num_kv_heads, world_size, rank) -> HeadShard(kv_heads, q_slots)
        the query heads split into world_size contiguous runs (the first num_heads % world_size runs
        one longer); the rank keeps every K/V head its run reads, widened to as many neighbouring
        K/V heads as the busiest rank needs; q_slots lists, per kept K/V head, its G = num_heads /
        num_kv_heads query heads, each the head itself if this rank computes it, else None

Two stages, each stopping at the first problem with a message that says where:
  1. taught cases (an even split, GQA groups, a K/V head straddling two ranks, more ranks than K/V
     heads, multi-head attention), then every small shape against `minikv.model.tensor_parallel.shard_heads`
  2. (check_shard_in_model) tiny-random cut into N ranks by your shards, the ranks run as threads
     whose all-reduce sums their partial outputs: the logits must equal the uncut model's

`simulate_tensor_parallel` is stage 2's machinery, also used by notebook 14: N ranks in one process,
no torch.distributed, so the arithmetic of the split can be watched on its own.
"""
from __future__ import annotations

import copy
import threading

import torch

from minikv.attention.metadata import BatchInputs
from minikv.attention.naive import NaiveBackend
from minikv.checks.report import fail, passed
from minikv.model.tensor_parallel import HeadShard, shard_all, shard_model
from minikv.model.tensor_parallel import shard_heads as reference_shard_heads

CASES = [  # (lesson, num_heads, num_kv_heads, world_size, hint)
    ("an even split: 8 heads, 8 K/V heads (multi-head attention), 2 ranks", 8, 8, 2,
     "rank r takes query heads [r * H / N, (r + 1) * H / N) and the K/V heads they read"),
    ("grouped-query attention: 4 heads read 2 K/V heads, 2 ranks: one group each", 4, 2, 2,
     "query head h reads K/V head h // G, with G = num_heads // num_kv_heads"),
    ("SmolLM2: 9 heads, 3 K/V heads, 2 ranks: K/V head 1's group straddles both ranks", 9, 3, 2,
     "rank 0 computes query heads 0-4 (the first run is one longer), so it needs K/V heads 0 and 1; rank 1 "
     "computes 5-8 and needs 1 and 2: K/V head 1 is held by both (replicated)"),
    ("SmolLM2 on 3 ranks: 3 divides 3, one K/V head each", 9, 3, 3, "each rank holds one whole group"),
    ("more ranks than K/V heads: 4 heads, 2 K/V heads, 4 ranks: each K/V head on 2 ranks", 4, 2, 4,
     "a rank whose query heads all read one K/V head holds just that one; its other slots are None"),
    ("Llama-3-70B on 16 GPUs: 64 heads, 8 K/V heads", 64, 8, 16, "4 query heads per rank, all in one group"),
    ("8 K/V heads on 3 ranks: the middle rank touches 4, so every rank holds 4", 32, 8, 3,
     "every rank holds as many K/V heads as the busiest one (one block table for every pool): widen the "
     "window of K/V heads, starting at the first one you need, but never past the last K/V head"),
]


def _ask(fn, case: str, h: int, kv: int, n: int, r: int):
    try:
        return fn(h, kv, n, r)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  shown to the learner
        fail(case, f"shard_heads({h}, {kv}, {n}, {r}) raised {type(e).__name__}: {e}", "expected a HeadShard")


def check_shard_heads(shard_heads) -> None:
    cases = [(f"case {i}: {lesson}", h, kv, n, hint) for i, (lesson, h, kv, n, hint) in enumerate(CASES)]
    cases += [(f"every shape: {h} heads, {kv} K/V heads, {n} ranks", h, kv, n,
               "query runs as even as possible, the first ones longer; K/V window of the busiest rank's size")
              for kv in (1, 2, 3, 4) for g in (1, 2, 3) for h in [kv * g] for n in range(1, h + 1)]
    for case, h, kv, n, hint in cases:
        for r in range(n):
            got, want = _ask(shard_heads, case, h, kv, n, r), reference_shard_heads(h, kv, n, r)
            if got is None:
                fail(case, f"shard_heads(..., rank={r}) returned None", f"expected {want}", "did it forget `return`?")
            if not isinstance(got, HeadShard):
                fail(case, f"rank {r}: shard_heads returned a {type(got).__name__}",
                     "expected HeadShard(kv_heads=(...), q_slots=(...))")
            got = HeadShard(tuple(got.kv_heads), tuple(got.q_slots))
            if got != want:
                fail(case, f"rank {r}: got {got}", f"expected {want}", hint)
    passed(len(cases), "every rank holds the heads it computes, every pool the same number of K/V heads")


class ThreadGroup:
    """N ranks as threads of one process; `all_reduce(rank)` is rank's in-place sum over the ranks,
    added up in rank order on every rank (so every rank gets the very same numbers)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=120)

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = self.slots[0].clone()
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()  # every rank has read every slot before any slot is written again
            t.copy_(total)
        return reduce


def _inputs(ids: list[int]) -> BatchInputs:
    t = torch.tensor(ids)
    n = len(ids)
    return BatchInputs(input_ids=t, positions=torch.arange(n), query_start_loc=torch.tensor([0, n]),
                       seq_lens=torch.tensor([n]), query_lens_list=[n], seq_lens_list=[n], max_seq_len=n)


@torch.no_grad()
def simulate_tensor_parallel(model, world_size: int, ids: list[int], shard_fn=reference_shard_heads
                             ) -> tuple[torch.Tensor, torch.Tensor, list[HeadShard]]:
    """Logits of every position of `ids` from the whole `model` and from `world_size` cut copies of it
    run as threads (rank 0's logits). Returns (whole, cut, the shards)."""
    cfg = model.config
    shards = shard_all(cfg.num_heads, cfg.num_kv_heads, world_size, shard_fn)
    backend, inputs = NaiveBackend(), _inputs(ids)
    whole = model(inputs.input_ids, inputs.positions, backend.prepare_metadata(inputs), backend)
    group, out, errors = ThreadGroup(world_size), [None] * world_size, []

    def rank_main(r: int, cut) -> None:
        try:
            out[r] = cut(inputs.input_ids, inputs.positions, backend.prepare_metadata(inputs), backend)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)
            group.barrier.abort()

    cuts = []
    for r in range(world_size):
        cut = copy.deepcopy(model)
        shard_model(cut, shards[r], r, world_size, group.all_reduce(r))
        cuts.append(cut)
    threads = [threading.Thread(target=rank_main, args=(r, cuts[r])) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return whole, out[0], shards


def check_shard_in_model(shard_heads, world_size: int = 3) -> None:
    """tiny-random (4 heads, 2 K/V heads) cut into `world_size` ranks by your shards: same logits."""
    from minikv.model.loader import load_model

    model = load_model("tiny-random").model
    ids = [5, 17, 42, 99, 3, 250, 7, 1]
    case = f"tiny-random (4 heads, 2 K/V heads) on {world_size} ranks, {len(ids)} tokens"
    try:
        whole, cut, shards = simulate_tensor_parallel(model, world_size, ids, shard_heads)
    except NotImplementedError:
        raise
    except ValueError as e:
        fail(case, "the shards cannot run", str(e))
    if not torch.allclose(whole, cut, atol=1e-4, rtol=1e-4):
        fail(case, "the cut model's logits differ from the whole model's",
             f"max abs difference {(whole - cut).abs().max().item():.3g}; shards {shards}",
             "each q slot must read the K/V head of its own group")
    if not torch.equal(whole.argmax(-1), cut.argmax(-1)):
        fail(case, "the cut model picks other greedy tokens",
             f"{whole.argmax(-1).tolist()} vs {cut.argmax(-1).tolist()}")
    passed(1, f"{world_size} ranks, each with its heads and its all-reduces, give the whole model's logits")


def check_shard_in_engine(shard_heads, world_size: int = 2) -> None:
    """Your shard_heads as the engine's seam: `LLM("tiny-random", tensor_parallel_size=N, shard_heads=...)`
    starts N - 1 worker processes (gloo), each rank keeps the heads your function gives it, and the
    greedy tokens must equal one process's."""
    from minikv import LLM, SamplingParams

    prompts, params = [[1, 2, 3, 4, 5], [9, 8, 7]], SamplingParams(max_tokens=6, ignore_eos=True)
    opts = dict(kv_backend="paged", device="cpu", dtype="float32", num_blocks=32, max_model_len=64)
    with LLM("tiny-random", **opts) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    case = f"tiny-random on {world_size} processes (torch.distributed, gloo), your shard_heads as the seam"
    try:
        with LLM("tiny-random", tensor_parallel_size=world_size, shard_heads=shard_heads, **opts) as llm:
            got = [o.token_ids for o in llm.generate(prompts, params)]
            ranks = llm.stats()["tensor_parallel"]["ranks"]
    except NotImplementedError:
        raise
    except ValueError as e:
        fail(case, "the engine refused your shards", str(e))
    if got != want:
        fail(case, "the greedy tokens differ from one process's", f"{got} vs {want}")
    heads = ", ".join(f"rank {r['rank']}: K/V heads {r['kv_heads']}" for r in ranks)
    passed(1, f"{world_size} processes give one process's tokens ({heads})")
