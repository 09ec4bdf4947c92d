"""Tensor parallelism (Megatron-LM's split): each of N ranks holds a slice of every layer, and two
all-reduces per layer put the slices back together.

    attention   q/k/v_proj   column-parallel   rank r computes ITS heads only (no communication)
                attention    per head          each rank attends with its own K/V heads, from its own pool
                o_proj       row-parallel      each rank multiplies its heads' columns -> a partial sum
                                               of the full hidden vector -> ALL-REDUCE (sum over ranks)
    MLP         gate/up      column-parallel   rank r computes its slice of the intermediate units
                down_proj    row-parallel      partial sums -> ALL-REDUCE

    embedding, norms, LM head   replicated: every rank holds them whole (see below)

Which heads a rank holds (`shard_heads`). Query heads are split into N contiguous runs as evenly as
possible; a rank keeps every K/V head its query heads read. Under grouped-query attention G = H / KV
query heads share one K/V head; when N does not divide the K/V heads (SmolLM2: 9 heads, 3 K/V heads,
N = 2) a K/V head whose group straddles two ranks is held by both, REPLICATED:

    SmolLM2, N = 2          q heads 0 1 2 | 3 4 5 | 6 7 8      (K/V head 0 | 1 | 2)
        rank 0  q heads 0-4     K/V heads 0, 1   local slots [0 1 2 | 3 4 -]
        rank 1  q heads 5-8     K/V heads 1, 2   local slots [- - 5 | 6 7 8]

Every rank holds the same number of K/V heads (the most any rank needs, ceil(KV / N) in the cases
that matter), so every rank's pool has the same bytes per block and the same block ids: one block
table serves all ranks. Locally each K/V head keeps its G query slots; a slot whose query head lives
on another rank is padding: zero rows in q_proj and zero columns in o_proj, so it adds exactly 0.0 to
the all-reduce. The cost of replication: K/V bytes per rank = ceil-share / KV of the model's instead
of 1 / N (SmolLM2 at N = 2: 2/3 instead of 1/2), and the padded slots' attention is computed and
thrown away.

Why the embedding and the LM head are replicated, not split by vocabulary: rank 0 samples, and it
needs whole logits rows; a vocabulary-parallel head would add an all-gather of the logits (and the
embedding an all-reduce) to every step. The price is memory: both matrices on every rank (an 8B
Llama: 2 x 128,256 x 4,096 x 2 bytes = 2 GiB per GPU). Ranks other than 0 never compute logits, so
they drop an untied LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minikv.model.config import ModelConfig

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank holds.

    kv_heads   the model's K/V heads this rank keeps, in order (the same count on every rank)
    q_slots    for each local K/V head, its G query slots: the model's query head in each slot, or
               None (padding: a query head that runs on another rank)"""

    kv_heads: tuple[int, ...]
    q_slots: tuple[int | None, ...]

    @property
    def q_heads(self) -> tuple[int, ...]:
        """The query heads this rank computes (the slots that are not padding)."""
        return tuple(h for h in self.q_slots if h is not None)


ShardHeadsFn = Callable[[int, int, int, int], HeadShard]


def split(n: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s run of n items split into world_size contiguous runs as evenly as possible (the
    first n % world_size runs get one more): split(9, 2, 0) = range(0, 5), split(9, 2, 1) = range(5, 9)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def check_sizes(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """world_size ranks can share these heads, or a ValueError naming the limit."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    if world_size > num_heads:
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's {num_heads} attention heads: some "
                         f"rank would hold no head; use at most {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} K/V groups")


def shard_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """The heads rank `rank` of `world_size` holds (see the top of the file): a contiguous run of query
    heads, the K/V heads they read, and as many more neighbouring K/V heads as the busiest rank needs,
    so that every rank's pool has the same shape."""
    check_sizes(num_heads, num_kv_heads, world_size)
    group = num_heads // num_kv_heads

    def touched(r: int) -> range:  # the K/V heads rank r's query heads read
        q = split(num_heads, world_size, r)
        return range(q.start // group, (q.stop - 1) // group + 1)

    num_local = max(len(touched(r)) for r in range(world_size))
    mine, q = touched(rank), split(num_heads, world_size, rank)
    first = min(mine.start, num_kv_heads - num_local)  # a window of num_local K/V heads around mine
    kv = tuple(range(first, first + num_local))
    slots = tuple(h if h in q else None for j in kv for h in range(j * group, (j + 1) * group))
    return HeadShard(kv, slots)


def check_shard(shard: HeadShard, num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """A shard the engine can run: slots laid out G per K/V head, each slot's query head reading its own
    K/V head; a ValueError says what is wrong."""
    group = num_heads // num_kv_heads
    if not isinstance(shard, HeadShard):
        raise ValueError(f"shard_heads must return a HeadShard(kv_heads, q_slots), got {shard!r}")
    if not shard.kv_heads or len(shard.q_slots) != group * len(shard.kv_heads):
        raise ValueError(f"{shard}: q_slots needs {group} slots (the group size) per K/V head")
    for i, h in enumerate(shard.q_slots):
        kv = shard.kv_heads[i // group]
        if h is not None and h // group != kv:
            raise ValueError(f"{shard}: slot {i} holds query head {h}, which reads K/V head {h // group}, "
                             f"but the slot belongs to K/V head {kv}")


def shard_all(num_heads: int, num_kv_heads: int, world_size: int, fn: ShardHeadsFn = shard_heads) -> list[HeadShard]:
    """Every rank's shard, checked: each query head computed by exactly one rank, every pool the same shape."""
    shards = [fn(num_heads, num_kv_heads, world_size, r) for r in range(world_size)]
    for s in shards:
        check_shard(s, num_heads, num_kv_heads, world_size)
    counts = sorted(h for s in shards for h in s.q_heads)
    if counts != list(range(num_heads)):
        raise ValueError(f"the shards must compute each of the {num_heads} query heads on exactly one rank; they "
                         f"compute {counts}")
    if len({len(s.kv_heads) for s in shards}) != 1:
        raise ValueError(f"every rank must hold the same number of K/V heads (one block table for all pools); "
                         f"got {[len(s.kv_heads) for s in shards]}")
    return shards


class RowParallelLinear(nn.Module):
    """y = x @ W_r^T, then summed over the ranks: each rank holds some input columns of W."""

    def __init__(self, weight: torch.Tensor, all_reduce: AllReduce):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out_features, local in_features]
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.all_reduce(y)
        return y


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return lin


def _pick_rows(w: torch.Tensor, heads: tuple[int | None, ...], head_dim: int) -> torch.Tensor:
    """Rows of w for each head (head_dim rows each), zeros for a padding slot (None)."""
    w = w.reshape(-1, head_dim, *w.shape[1:])
    zero = torch.zeros_like(w[0])
    return torch.cat([w[h] if h is not None else zero for h in heads])


@torch.no_grad()
def shard_model(model, shard: HeadShard, rank: int, world_size: int, all_reduce: AllReduce,
                keep_lm_head: bool = True) -> ModelConfig:
    """Cut `model` (a LlamaForCausalLM, in place) down to rank `rank`'s slice: its heads (`shard`) and
    its run of the MLP's intermediate units; o_proj and down_proj sum over the ranks with `all_reduce`.
    Returns the config of the local model (its head counts: what its KV pool is built from)."""
    cfg: ModelConfig = model.config
    hd = cfg.head_dim
    units = split(cfg.intermediate_size, world_size, rank)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_bias = attn.q_proj.bias
        attn.q_proj = _linear(_pick_rows(attn.q_proj.weight, shard.q_slots, hd),
                              None if q_bias is None else _pick_rows(q_bias, shard.q_slots, hd))
        for name in ("k_proj", "v_proj"):
            lin = getattr(attn, name)
            setattr(attn, name, _linear(_pick_rows(lin.weight, shard.kv_heads, hd),
                                        None if lin.bias is None else _pick_rows(lin.bias, shard.kv_heads, hd)))
        o_cols = _pick_rows(attn.o_proj.weight.t(), shard.q_slots, hd).t()  # columns of o_proj, per slot
        attn.o_proj = RowParallelLinear(o_cols.contiguous(), all_reduce)
        attn.num_heads, attn.num_kv_heads = len(shard.q_slots), len(shard.kv_heads)
        mlp.gate_proj = _linear(mlp.gate_proj.weight[units.start:units.stop], None)
        mlp.up_proj = _linear(mlp.up_proj.weight[units.start:units.stop], None)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, units.start:units.stop].contiguous(), all_reduce)
        attn.qkv_weight = attn.qkv_bias = mlp.gate_up_weight = None  # the merged full matrices go
    if not keep_lm_head and not cfg.tie_word_embeddings:
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.new_empty(0, cfg.hidden_size), requires_grad=False)
    model._merge_projections()
    return replace(cfg, num_heads=len(shard.q_slots), num_kv_heads=len(shard.kv_heads),
                   intermediate_size=len(units))


# ---- the calculator: K/V bytes each GPU holds, and what the all-reduces move -------------------------
def kv_bytes_per_token_per_gpu(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, world_size: int,
                               dtype_bytes: int = 2, mode: str = "tp") -> int:
    """K and V bytes of one token on the busiest GPU of `world_size`:

        tp  every GPU holds every layer, its share of the K/V heads (replicated heads counted: `shard_heads`)
        pp  every GPU (a pipeline stage) holds all the K/V heads of its run of layers; the K/V of a
            layer lives on the stage that computes it, so nothing is recomputed or moved"""
    if mode == "tp":
        heads = len(shard_heads(num_heads, num_kv_heads, world_size, 0).kv_heads)
        return 2 * num_layers * heads * head_dim * dtype_bytes
    if mode == "pp":
        if not 1 <= world_size <= num_layers:
            raise ValueError(f"{world_size} pipeline stages for {num_layers} layers; use 1 to {num_layers}")
        layers = max(len(split(num_layers, world_size, r)) for r in range(world_size))
        return 2 * layers * num_kv_heads * head_dim * dtype_bytes
    raise ValueError(f"mode must be 'tp' or 'pp', got {mode!r}")


def allreduce_bytes_per_step(num_layers: int, hidden_size: int, num_tokens: int, dtype_bytes: int = 2) -> int:
    """The bytes tensor parallelism all-reduces in one step: 2 per layer (after o_proj and after
    down_proj), each the [num_tokens, hidden_size] activations."""
    return 2 * num_layers * num_tokens * hidden_size * dtype_bytes
