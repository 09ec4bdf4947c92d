"""Every option of the engine in one frozen object, checked in one place.

    LLM("smollm2-135m", kv_backend="paged", block_size=16)
        -> EngineConfig.from_options(...)   every option checked, alone and against the others
        -> config.fit(model, machine)       a NEW config: the sizes that need the model resolved

Two phases, because some limits are only known once the weights are loaded:

    from_options    every option on its own and the options against each other: types, ranges, which
                    options belong to which rung (a block size means nothing without a paged pool)
    fit(model)      the options against the model and the machine: max_model_len against the model's
                    positions, the pool's size in blocks against memory, the token budget against
                    max_model_len. Fills in every size left as None, and says in `chosen` which
                    sizes it picked itself and why.

The result is frozen and nested (pool, scheduling, prefix, offload, execution, seams): nothing
changes a config in place, and what fit chose is part of the config it returns, never an input.
Every error names the option, the value it got, the limit, and the fix.

The named seams (where a learner's code enters the engine) are options too, checked here like the
others: a seam given to a rung that does not use it is an error, never silently ignored.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from minikv.engine.cuda_graph import step_graph_tokens

KV_BACKENDS = ("naive", "contiguous", "paged")
ATTENTION_IMPLS = ("torch", "triton")
KV_LAYOUTS = ("nhd", "hnd")
PREEMPTION_MODES = ("recompute", "swap")
PREFIX_CACHING = ("hash", "radix")
EVICTION_POLICIES = ("lru", "fifo")
SCHEDULE_POLICIES = ("fcfs", "lpm", "vtc")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 4, 1024
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = {"naive": 1, "contiguous": 4, "paged": 32}
DEFAULT_CPU_KV_MEMORY = 256 * 2**20  # bytes of paged pool on a CPU when neither num_blocks nor kv_cache_memory is given
DEFAULT_GPU_KV_FRACTION = 0.9  # of the free device memory at start-up, less what a step's activations need
GPU_MAX_NUM_SEQS = {"small": 256, "large": 512}  # by device memory: under / over LARGE_GPU_MEMORY
GPU_MAX_NUM_BATCHED_TOKENS = {"small": 8192, "large": 16384}
LARGE_GPU_MEMORY = 70 * 2**30  # bytes: an 80 GB H100 or larger counts as large (vLLM draws the line here too)
MIN_TOKENS_PER_SEQ = 1024  # defaults keep a pool able to hold this many tokens of every running sequence


@dataclass(frozen=True)
class DeviceInfo:
    """What the defaults look at: the card's name, total and free memory (bytes), and SM count. Tests
    pass a made-up one to see what a given card would get."""

    name: str
    total_memory: int
    free_memory: int
    num_sms: int = 0

    @classmethod
    def of(cls, device: torch.device) -> "DeviceInfo":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(props.name, total, free, props.multi_processor_count)


@dataclass(frozen=True)
class ScratchShape:
    """The model sizes a step's scratch memory depends on."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int


def step_scratch_bytes(shape: ScratchShape, max_num_batched_tokens: int, max_num_seqs: int,
                       graph_tokens: int = 0) -> int:
    """A generous bound on the memory one step needs besides weights and pool: the largest step's
    activations (residual, norms, q/k/v, MLP's gate, up and product: ~6 x hidden + 3 x intermediate per
    token) and the logits of every sampled row in float32 with the sampler's temporaries (8x: its noise
    over a whole vocabulary is int64), plus 1 GiB for decode graphs, cuBLAS workspaces and the allocator.
    Step graphs of up to `graph_tokens` keep their largest step's activations in their own pool, beside
    what an eager step uses: as many bytes again for that many tokens (0.33 GB at 8,192 tokens for
    Qwen2.5-0.5B, 1.1 GB for Llama-3.1-8B)."""
    per_token = (6 * shape.hidden_size + 3 * shape.intermediate_size) * shape.dtype_bytes
    logits = 8 * max_num_seqs * shape.vocab_size * 4
    return (max_num_batched_tokens + graph_tokens) * per_token + logits + 2**30


def gpu_defaults(info: DeviceInfo, shape: ScratchShape, bytes_per_block: int, block_size: int, max_model_len: int,
                 max_num_seqs: int | None, max_num_batched_tokens: int | None, pool_bytes: int | None,
                 cap_seqs: bool = True, graph_tokens: int = 0) -> dict[str, int]:
    """max_num_seqs, max_num_batched_tokens and num_blocks for a paged engine on this card, each only
    where not given (None). As vLLM and nano-vllm do: hundreds of sequences, a budget in the thousands,
    and the pool takes what the weights and a step's scratch leave of the free memory.

        large card (>= 70 GiB):  512 sequences, 16,384 tokens per step
        smaller card:            256 sequences,  8,192 tokens per step
        then: the budget at least max_model_len (a whole prompt fits one step) and max_num_seqs;
              max_num_seqs at most the pool's tokens / min(max_model_len, 1,024), unless cap_seqs is
              False (a pool given in blocks: its owner sized it, often small on purpose, to see preemption)
    graph_tokens: cuda_graph_max_tokens with step graphs on, else 0; the reserve counts `step_graph_tokens` of it."""
    size = "large" if info.total_memory >= LARGE_GPU_MEMORY else "small"
    seqs = max_num_seqs if max_num_seqs is not None else GPU_MAX_NUM_SEQS[size]
    budget = max_num_batched_tokens
    if budget is None:
        budget = max(GPU_MAX_NUM_BATCHED_TOKENS[size], max_model_len, seqs)
    out = {"max_num_seqs": seqs, "max_num_batched_tokens": budget}
    if pool_bytes is None:
        pool_bytes = (int(info.free_memory * DEFAULT_GPU_KV_FRACTION)
                      - step_scratch_bytes(shape, budget, seqs, step_graph_tokens(graph_tokens, budget, max_model_len)))
    out["num_blocks"] = max(0, pool_bytes // bytes_per_block)
    if max_num_seqs is None and cap_seqs:
        capacity = out["num_blocks"] * block_size
        out["max_num_seqs"] = max(1, min(seqs, capacity // min(max_model_len, MIN_TOKENS_PER_SEQ)))
    return out

# seam -> (the rung it belongs to, a predicate on the config, what to do instead)
SEAMS: dict[str, tuple[str, Callable[["_Draft"], bool], str]] = {
    "causal_attention": ("rung 1", lambda c: c.kv_backend == "naive", "kv_backend='naive'"),
    "decode_step": ("rung 2", lambda c: c.kv_backend == "contiguous", "kv_backend='contiguous'"),
    "slot_mapping": ("rung 4", lambda c: c.is_paged, "kv_backend='paged'"),
    "schedule_step": ("rung 5", lambda c: c.is_paged and c.prefix_caching is None,
                      "kv_backend='paged' with prefix_caching=None (the exercise's scheduler does not match prefixes)"),
    "copy_on_write": ("rung 6", lambda c: c.is_paged, "kv_backend='paged'"),
    "decode_inner_loop": ("rung 7", lambda c: c.attention == "triton", "kv_backend='paged', attention='triton'"),
    "window_free_rule": ("rung 8", lambda c: c.is_paged and c.sliding_window is not None,
                         "kv_backend='paged' and a sliding_window=W"),
    "kv_quantizer": ("rung 8", lambda c: c.is_paged and c.kv_cache_dtype != "auto",
                     "kv_backend='paged' and kv_cache_dtype='int8' or 'fp8'"),
    "radix_insert": ("rung 6", lambda c: c.is_paged and c.prefix_caching == "radix",
                     "kv_backend='paged', prefix_caching='radix'"),
    "radix_evict_leaf": ("rung 6", lambda c: c.is_paged and c.prefix_caching == "radix",
                         "kv_backend='paged', prefix_caching='radix'"),
    "free_block_queue": ("rung 6", lambda c: c.is_paged and c.prefix_caching == "hash" and c.eviction == "lru",
                         "kv_backend='paged', prefix_caching='hash', eviction='lru' (the queue holds the hash "
                         "chain's unused blocks, least recently used first)"),
    "pick_next": ("rung 10", lambda c: c.is_paged and c.schedule_policy == "vtc",
                  "kv_backend='paged', schedule_policy='vtc' (it orders the waiting requests of the fair scheduler)"),
    "kv_offload_store": ("rung 9", lambda c: c.is_paged and _is_hash_chain(c.prefix_caching),
                         "kv_backend='paged', prefix_caching='hash'"),
    "spec_rollback": ("rung 11", lambda c: c.speculative is not None,
                      "kv_backend='paged' and speculative='ngram' or 'draft'"),
    "shard_heads": ("rung 12", lambda c: _is_int(c.tensor_parallel_size) and c.tensor_parallel_size > 1,
                    "tensor_parallel_size=N with N > 1"),
}


def _is_hash_chain(p: Any) -> bool:
    """prefix_caching names the hash chain (the offload tiers key blocks by its chain keys)."""
    return p == "hash" or getattr(p, "design", None) == "hash"


def _is_store(x: Any) -> bool:
    return all(callable(getattr(x, m, None)) for m in ("put", "get", "__contains__"))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, value: Any, minimum: int, fix: str = "", allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}"
                         + (f"; {fix}" if fix else ""))


def _check_choice(name: str, value: Any, choices: tuple[str, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}one of {', '.join(choices)}, got {value!r}")


def parse_device(device: Any) -> torch.device:
    """None -> the GPU if there is one, else the CPU. A CUDA device without CUDA is an error, not a crash later."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or None: the GPU if there is one), "
                         f"got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; minikv runs on 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but this machine has no CUDA device (torch {torch.__version__}); "
                             "use device='cpu' or leave device=None")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def parse_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """None -> bfloat16 on a GPU, float32 on a CPU; names as in torch ("float16") or short ("bf16")."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype must be one of float32, float16, bfloat16 (a torch.dtype or its name) or None, "
                     f"got {dtype!r}")


def memory_available(device: torch.device) -> int:
    """Bytes a KV pool may take at most: the free memory of a GPU, the physical memory of the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no limit we can state
        return 2**62


@dataclass
class _Draft:
    """The options of `LLM(...)` while they are checked and resolved (see `LLM.__init__` for what
    each one means): a flat, mutable draft that `EngineConfig.from_options` and `EngineConfig.fit`
    fill in and then freeze. Nothing outside this module holds one."""

    model: Any = "smollm2-135m"
    device: Any = None
    dtype: Any = None
    kv_backend: str | None = None  # None: "paged" on a GPU (the fastest rung), "contiguous" on a CPU
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    # paged pool (rungs 4-7)
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    preemption: str = "recompute"
    swap_blocks: int | None = None
    attention: str | None = None
    kv_layout: str | None = None
    cuda_graphs: bool | None = None
    cuda_graph_max_tokens: int = 8192  # with cuda_graphs: steps of up to this many tokens replay too (0: decode only)
    async_scheduling: bool | None = None  # overlap step t+1's host work with step t on the device (paged)
    kv_cache_dtype: str = "auto"  # what the pool stores: "auto" (the model's dtype), "int8" or "fp8" (e4m3)
    fused_ops: bool | None = None  # the model's fused Triton kernels and merged matmuls; None: on a GPU only
    # prefix caching (rung 6)
    prefix_caching: Any = None
    eviction: str = "lru"
    schedule_policy: str = "fcfs"
    # sliding window with sink tokens (rung 8): None = the model's own window (if its config has one)
    sliding_window: int | None = None
    sink_tokens: int = 0
    # named seams: a learner's code plugged into the engine
    block_allocator: Any = None
    slot_mapping: Callable | None = None
    causal_attention: Callable | None = None
    decode_step: Callable | None = None
    schedule_step: Callable | None = None
    copy_on_write: Callable | None = None
    decode_inner_loop: Any = None
    window_free_rule: Callable | None = None
    kv_quantizer: Callable | None = None
    pick_next: Callable | None = None
    radix_insert: Callable | None = None
    radix_evict_leaf: Callable | None = None
    free_block_queue: Any = None  # a class: free_block_queue() is an empty queue
    # filled by fit(): each size it chose itself -> why (printed once on a GPU, and in LLM.stats()); an
    # output, never an option
    chosen: dict = field(default_factory=dict, repr=False, init=False)
    # offload tiers below the prefix cache (rung 9)
    kv_offload_cpu_bytes: int | None = None
    kv_offload_dir: Any = None
    kv_offload_disk_bytes: int | None = None
    kv_offload_store: Any = None  # the rung-9 seam: a BlockStore (put, get, in) or a function making one
    # speculative decoding (rung 11, paged): minikv/engine/speculative.py
    speculative: str | None = None  # "ngram" (prompt lookup) or "draft" (draft_model proposes)
    num_speculative_tokens: int | None = None  # k drafts per step (default 4 when speculative is set)
    draft_model: Any = None  # a model name / path / LoadedModel sharing the tokenizer, or "self:N"
    speculative_disable_by_batch_size: int | None = None  # no drafts while more requests than this run
    spec_rollback: Callable | None = None  # the rung-11 seam: gives back the blocks of rejected drafts
    # tensor parallelism (rung 12, minikv/engine/parallel.py): N processes, each with 1/N of every layer
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0  # seconds a collective waits for a silent rank before the engine fails
    shard_heads: Callable | None = None  # the rung-12 seam: which heads each rank holds

    @property
    def is_paged(self) -> bool:
        return self.kv_backend == "paged"

    def __post_init__(self) -> None:
        if self.kv_backend is None:
            self.kv_backend = "paged" if parse_device(self.device).type == "cuda" or self.tensor_parallel_size != 1 \
                else "contiguous"
        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {self.kv_backend!r}; choose one of {', '.join(KV_BACKENDS)}")
        self.device = parse_device(self.device)
        self.dtype = parse_dtype(self.dtype, self.device)
        _check_int("max_model_len", self.max_model_len, 1, "it is the longest prompt + output a request may have")
        _check_int("max_num_seqs", self.max_num_seqs, 1, "it is how many requests run at once")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.attention is None:
            self.attention = "triton" if self.is_paged and self.device.type == "cuda" else "torch"
        _check_choice("attention", self.attention, ATTENTION_IMPLS)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (on where supported), got {self.cuda_graphs!r}")
        if (not isinstance(self.cuda_graph_max_tokens, int) or isinstance(self.cuda_graph_max_tokens, bool)
                or not (self.cuda_graph_max_tokens == 0 or 16 <= self.cuda_graph_max_tokens <= 8192)):
            raise ValueError(f"cuda_graph_max_tokens must be 0 (graphs for decode steps only) or 16 to 8,192 tokens "
                             f"(steps up to that size replay from graphs), got {self.cuda_graph_max_tokens!r}")
        self._check_paged_options()
        self._check_prefix_options()
        self._check_offload_options()
        self._check_seams()
        self._check_window()
        self._check_speculative()
        self._check_tensor_parallel()
        if self.attention == "triton" and self.device.type != "cuda" and self.dtype == torch.bfloat16:
            raise ValueError("the Triton kernels run in the interpreter on a CPU, whose bfloat16 arithmetic is "
                             "wrong; use dtype float32 or float16 there (bfloat16 is fine on a GPU)")
        if self.fused_ops is None:
            self.fused_ops = self.device.type == "cuda"
        if not isinstance(self.fused_ops, bool):
            raise ValueError(f"fused_ops must be True, False or None (on a GPU only), got {self.fused_ops!r}")
        if self.fused_ops and self.device.type != "cuda" and self.dtype == torch.bfloat16:
            raise ValueError("fused_ops runs Triton kernels, in the interpreter on a CPU, whose bfloat16 arithmetic "
                             "is wrong; use dtype float32 or float16 there, or fused_ops=False")
        if self.kv_quantizer is not None and self.cuda_graphs:
            raise ValueError("kv_quantizer runs your torch function at every store, which a CUDA graph cannot "
                             "replay; set cuda_graphs=False to use it")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (on for a paged engine on a GPU), "
                             f"got {self.async_scheduling!r}")
        if self.async_scheduling and not self.is_paged:
            raise ValueError(f"async_scheduling overlaps the steps of the paged engine, but kv_backend is "
                             f"{self.kv_backend!r}; use kv_backend='paged' or async_scheduling=False")
        if self.async_scheduling is None:
            self.async_scheduling = self.is_paged and self.device.type == "cuda"
        if self.cuda_graphs is None:
            self.cuda_graphs = (self.device.type == "cuda" and self.attention == "triton"
                                and self.kv_quantizer is None)
        elif self.cuda_graphs and (self.device.type != "cuda" or self.attention != "triton"):
            raise ValueError(f"cuda_graphs replays decode steps of the Triton kernels on a GPU (here: device "
                             f"{self.device.type}, attention {self.attention!r}, kv_backend {self.kv_backend!r}); "
                             "use kv_backend='paged', attention='triton' on a CUDA device, or cuda_graphs=False")

    def _check_tensor_parallel(self) -> None:
        """tensor_parallel_size against the machine and the features that run on rank 0 alone."""
        n = self.tensor_parallel_size
        _check_int("tensor_parallel_size", n, 1, "it is how many processes (GPUs) share the model", allow_none=False)
        t = self.tensor_parallel_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
            raise ValueError(f"tensor_parallel_timeout must be a number of seconds > 0, got {t!r}")
        if n == 1:
            return
        if self.device.type == "cuda" and n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={n} puts one rank on each GPU but this machine has "
                             f"{torch.cuda.device_count()}; use at most {torch.cuda.device_count()}")
        if not self.is_paged:
            raise ValueError(f"tensor_parallel_size={n} shards the paged pool (one block table for every rank's "
                             f"heads), but kv_backend is {self.kv_backend!r}; use kv_backend='paged'")
        refused = {"preemption='swap'": self.preemption == "swap",
                   "the offload tiers (kv_offload_*)": self.kv_offload_cpu_bytes is not None
                   or self.kv_offload_dir is not None or self.kv_offload_store is not None,
                   f"kv_cache_dtype={self.kv_cache_dtype!r}": self.kv_cache_dtype != "auto",
                   "cuda_graphs=True": self.cuda_graphs is True,
                   "async_scheduling=True": self.async_scheduling is True,
                   "the decode_inner_loop seam": self.decode_inner_loop is not None,
                   f"speculative={self.speculative!r}": self.speculative is not None}
        for what, given in refused.items():
            if given:
                raise ValueError(f"{what} does not run under tensor parallelism (tensor_parallel_size={n}): rank 0 "
                                 "alone would act on it; drop it, or use tensor_parallel_size=1")
        self.cuda_graphs, self.async_scheduling = False, False

    def _paged_only(self, name: str, given: bool) -> None:
        if given and not self.is_paged:
            raise ValueError(f"{name} is an option of the paged pool (rungs 4-7) but kv_backend is "
                             f"{self.kv_backend!r}; use kv_backend='paged' or drop {name}")

    def _check_paged_options(self) -> None:
        d = {f.name: f.default for f in fields(self)}
        for name in ("num_blocks", "kv_cache_memory", "max_num_batched_tokens", "swap_blocks", "kv_layout",
                     "block_allocator"):
            self._paged_only(name, getattr(self, name) is not None)
        for name in ("block_size", "enable_chunked_prefill", "preemption"):
            self._paged_only(name, getattr(self, name) != d[name])
        if self.attention == "triton" and not self.is_paged:
            raise ValueError("attention='triton' runs on the paged pool; use kv_backend='paged'")
        b = self.block_size
        if not _is_int(b) or b & (b - 1) or not MIN_BLOCK_SIZE <= b <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {b!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError(f"give num_blocks ({self.num_blocks!r}) or kv_cache_memory ({self.kv_cache_memory!r}), "
                             "not both: each sizes the pool")
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("kv_cache_memory", self.kv_cache_memory, 1, "give a number of bytes, e.g. 2 * 2**30 for 2 GiB")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("swap_blocks", self.swap_blocks, 0, "it is the number of CPU blocks of the swap space")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}")
        _check_choice("preemption", self.preemption, PREEMPTION_MODES)
        if self.preemption == "swap" and self.swap_blocks == 0:
            raise ValueError("preemption='swap' needs a swap space; give swap_blocks > 0 (default: num_blocks)")
        _check_choice("kv_layout", self.kv_layout, KV_LAYOUTS, allow_none=True)
        self._check_kv_cache_dtype()
        if self.is_paged and self.kv_layout is None:
            self.kv_layout = "hnd" if self.attention == "triton" else "nhd"

    def _check_kv_cache_dtype(self) -> None:
        from minikv.cache.blocks.quant import KV_CACHE_DTYPES, fp8_supported

        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "auto":
            return
        if not self.is_paged:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} quantizes the blocks of the paged pool, but "
                             f"kv_backend is {self.kv_backend!r}; use kv_backend='paged' or kv_cache_dtype='auto'")
        if self.kv_cache_dtype == "fp8":
            why = fp8_supported(self.device)
            if why is not None:
                raise ValueError(f"kv_cache_dtype='fp8' needs float8 (e4m3) types: {why}; use kv_cache_dtype='int8'")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the paged pool stores K/V in (kv_cache_dtype resolved against the model's dtype)."""
        from minikv.cache.blocks.quant import cache_dtype

        return cache_dtype(self.kv_cache_dtype, self.dtype)

    def _check_prefix_options(self) -> None:
        from minikv.cache.prefix.base import PrefixCache

        p = self.prefix_caching
        if p is not None and not isinstance(p, PrefixCache):
            _check_choice("prefix_caching", p, PREFIX_CACHING, allow_none=True)
        self._paged_only("prefix_caching", p is not None)
        _check_choice("eviction", self.eviction, EVICTION_POLICIES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        if self.schedule_policy == "vtc" and not self.is_paged:
            raise ValueError("schedule_policy='vtc' (fair between tenants) is a policy of the continuous-batching "
                             "scheduler; use kv_backend='paged'")
        if self.schedule_policy == "vtc" and self.schedule_step is not None:
            raise ValueError("schedule_step decides the whole step itself, so schedule_policy='vtc' would be ignored; "
                             "give one or the other")
        if self.schedule_policy == "lpm" and p is None:
            raise ValueError("schedule_policy='lpm' orders requests by their cached prefix; turn prefix_caching on")
        if isinstance(p, PrefixCache) and p.block_size != self.block_size:
            raise ValueError(f"the prefix cache was built for block_size {p.block_size}, the engine uses "
                             f"{self.block_size}; build it with the engine's block_size")

    @property
    def offloads(self) -> bool:
        return self.kv_offload_cpu_bytes is not None or self.kv_offload_dir is not None

    def _check_offload_options(self) -> None:
        for name in ("kv_offload_cpu_bytes", "kv_offload_dir", "kv_offload_disk_bytes"):
            self._paged_only(name, getattr(self, name) is not None)
        _check_int("kv_offload_cpu_bytes", self.kv_offload_cpu_bytes, 1, "give a number of bytes, e.g. 2**30 for 1 GiB")
        _check_int("kv_offload_disk_bytes", self.kv_offload_disk_bytes, 1, "give a number of bytes, e.g. 8 * 2**30")
        d = self.kv_offload_dir
        if d is not None and not isinstance(d, (str, os.PathLike)):
            raise ValueError(f"kv_offload_dir must be a directory path (str or os.PathLike), got {d!r}")
        if self.kv_offload_disk_bytes is not None and d is None:
            raise ValueError("kv_offload_disk_bytes sizes the disk tier; give kv_offload_dir=PATH too")
        if self.offloads and not _is_hash_chain(self.prefix_caching):
            raise ValueError(f"the KV offload tiers keep blocks the prefix cache evicts, keyed by its hash chain; "
                             f"use prefix_caching='hash' (got {self.prefix_caching!r})")
        if self.offloads and self.kv_offload_store is not None:
            raise ValueError("give kv_offload_store (your own store) or kv_offload_cpu_bytes / kv_offload_dir "
                             "(the engine's tiers), not both")

    def _check_seams(self) -> None:
        for name, (rung, fits, use) in SEAMS.items():
            fn = getattr(self, name)
            if fn is None:
                continue
            if not callable(fn) and not (name == "kv_offload_store" and _is_store(fn)):
                what = "a class" if name == "free_block_queue" else "a function"
                raise ValueError(f"{name} must be {what} (the {rung} seam), got {type(fn).__name__} {fn!r}")
            if not fits(self):
                raise ValueError(f"{name} plugs into {rung}; build the LLM with {use} to use it")
        if self.decode_inner_loop is not None:
            from minikv.kernels.decode_attention import check_inner_loop

            try:
                check_inner_loop(self.decode_inner_loop)
            except TypeError as e:
                raise ValueError(f"decode_inner_loop: {e}") from None
        if self.block_allocator is not None and not (isinstance(self.block_allocator, type) or all(
                hasattr(self.block_allocator, m) for m in ("allocate", "free", "num_free_blocks"))):
            raise ValueError("block_allocator must be a class called with num_blocks, or an object with allocate(), "
                             f"free(block_id) and num_free_blocks; got {self.block_allocator!r}")

    def _check_speculative(self) -> None:
        from minikv.engine.speculative import METHODS

        _check_choice("speculative", self.speculative, METHODS, allow_none=True)
        if self.speculative is None:
            for name in ("num_speculative_tokens", "draft_model", "speculative_disable_by_batch_size"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is an option of speculative decoding; give speculative='ngram' or "
                                     f"'draft' too, or drop {name}")
            return
        if not self.is_paged:
            raise ValueError(f"speculative decoding verifies the drafts in one step of the paged pool, but kv_backend "
                             f"is {self.kv_backend!r}; use kv_backend='paged'")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 4
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   "it is how many draft tokens each step verifies (4 is a good start)", allow_none=False)
        _check_int("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, 1,
                   "speculation stops while more requests than this run")
        if self.speculative_disable_by_batch_size is None and self.device.type == "cuda":
            from minikv.engine.speculative import GPU_MAX_SPECULATIVE_BATCH
            self.speculative_disable_by_batch_size = GPU_MAX_SPECULATIVE_BATCH
        if self.speculative == "draft" and self.draft_model is None:
            raise ValueError("speculative='draft' needs draft_model: a smaller model sharing the tokenizer, or "
                             "'self:N' (the target's first N layers and its LM head)")
        if self.speculative == "ngram" and self.draft_model is not None:
            raise ValueError(f"draft_model={self.draft_model!r} is for speculative='draft'; n-gram drafts come from "
                             "the request's own tokens")
        if self.async_scheduling:
            raise ValueError("speculative decoding needs each step's accepted tokens before the next is scheduled; "
                             "use async_scheduling=False (or None) with it")
        self.async_scheduling = False
        if self.schedule_step is not None:
            raise ValueError("schedule_step (rung 5) decides without knowing about draft tokens; drop it or "
                             "speculative")

    def _check_window(self, source: str = "sliding_window") -> None:
        """The window and its sinks, on their own and against the pool (again in `fit` once the model's
        own window is known: `source` names where the window came from)."""
        w, s = self.sliding_window, self.sink_tokens
        self._paged_only("sliding_window", w is not None and source == "sliding_window")
        self._paged_only("sink_tokens", s != 0)
        _check_int("sliding_window", w, 1, "it is how many of the last positions each query sees")
        _check_int("sink_tokens", s, 0, "it is how many first positions every query sees too", allow_none=False)
        if w is None:  # the model's own window, if any, comes in `fit`
            return
        if w < self.block_size:
            raise ValueError(f"{source}={w} is smaller than a block (block_size {self.block_size}): a window frees "
                             f"whole blocks; use a window of at least {self.block_size} tokens or a smaller block_size")
        if s > w:
            raise ValueError(f"sink_tokens={s} is larger than {source}={w}; the sinks are a few first tokens "
                             f"(StreamingLLM keeps 4) beside the window: use sink_tokens <= {w}")
        if self.prefix_caching == "radix" or getattr(self.prefix_caching, "design", None) == "radix":
            raise ValueError(f"{source}={w} gives back blocks in the middle of a cached prefix, which the radix tree "
                             "(it evicts leaves only) cannot hold; use prefix_caching='hash' with a window")

    def window_blocks(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once: all of them without a window;
        with one, the blocks of its sinks, of its window and of one step's new tokens (+1: the window
        starts mid-block). Needs max_num_batched_tokens (filled in by `fit`)."""
        bs = self.block_size
        full = -(-num_tokens // bs)
        if self.sliding_window is None:
            return full
        steps = self.max_num_batched_tokens if self.enable_chunked_prefill else num_tokens
        return min(full, -(-self.sink_tokens // bs) + -(-(self.sliding_window - 1 + steps) // bs) + 1)

    @property
    def uses_learner_attention(self) -> bool:
        return self.causal_attention is not None or self.decode_step is not None

    # ---- phase 2: against the model and the machine ------------------------------------------------
    def fit(self, max_positions: int, bytes_per_block: int | None = None, model_window: int | None = None,
            shape: ScratchShape | None = None, info: DeviceInfo | None = None) -> None:
        """Fill in the sizes left as None and check them against the model (its number of positions, its
        own sliding window) and, for a paged pool, against memory (`bytes_per_block`: K and V of one
        block, all layers). On a GPU a paged engine's sizes come from the card and the model
        (`gpu_defaults`; `shape` gives the model's sizes, `info` the card: DeviceInfo.of(device) unless given)."""
        if self.is_paged and self.sliding_window is None and model_window is not None:
            self.sliding_window = model_window  # the model was trained with it: the pool frees blocks by it
            self._check_window("the model's sliding_window")
        if self.is_paged and self.sliding_window is None and self.sink_tokens:
            raise ValueError(f"sink_tokens={self.sink_tokens} keeps the first tokens in sight beside a sliding window, "
                             "but there is none (the model has no window of its own); give sliding_window=W too")
        if self.max_model_len is not None and self.max_model_len > max_positions:
            raise ValueError(f"max_model_len {self.max_model_len:,} exceeds the model's {max_positions:,} positions; "
                             "lower it")
        given_len = self.max_model_len
        if self.max_model_len is None:
            self.max_model_len = min(max_positions, DEFAULT_MAX_MODEL_LEN)
        on_gpu = self.is_paged and (info is not None or self.device.type == "cuda")
        if self.max_num_seqs is None and not on_gpu:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS[self.kv_backend]
            self.chosen["max_num_seqs"] = f"the {self.kv_backend} rung's default"
        if not self.is_paged:
            return
        assert bytes_per_block is not None, "a paged config is fitted with the pool's bytes per block"
        if on_gpu:
            info = info if info is not None else DeviceInfo.of(self.device)
            available = info.free_memory
            shape = shape if shape is not None else ScratchShape(4096, 14336, 128256, 2)  # an 8B model: a safe bound
            picked = gpu_defaults(info, shape, bytes_per_block, self.block_size, self.max_model_len, self.max_num_seqs,
                                  self.max_num_batched_tokens, self.kv_cache_memory if self.num_blocks is None else
                                  self.num_blocks * bytes_per_block, cap_seqs=self.num_blocks is None,
                                  graph_tokens=self.cuda_graph_max_tokens if self.cuda_graphs else 0)
            why = f"fitted to {info.name} ({info.total_memory / 2**30:.0f} GiB, {info.free_memory / 2**30:.0f} free)"
            for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks"):
                if getattr(self, name) is None and not (name == "num_blocks" and self.kv_cache_memory is not None):
                    setattr(self, name, picked[name])
                    self.chosen[name] = why
            if self.num_blocks is None:  # kv_cache_memory given
                self.num_blocks = picked["num_blocks"]
        else:
            available = memory_available(self.device)
        if self.num_blocks is None:
            memory = self.kv_cache_memory
            if memory is None:
                memory = DEFAULT_CPU_KV_MEMORY
                self.chosen["num_blocks"] = f"{DEFAULT_CPU_KV_MEMORY // 2**20} MiB of pool on a CPU"
            self.num_blocks = memory // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"the pool holds no block of {bytes_per_block:,} bytes (block_size {self.block_size}; "
                             f"{available / 2**30:,.1f} GiB free); give more memory (kv_cache_memory, num_blocks) "
                             "or a smaller block_size")
        need = self.num_blocks * bytes_per_block
        if need > available:
            raise ValueError(f"num_blocks={self.num_blocks:,} blocks of {bytes_per_block:,} bytes need "
                             f"{need / 2**30:,.1f} GiB but the {self.device.type} has {available / 2**30:,.1f} GiB; "
                             f"lower num_blocks (at most {available // bytes_per_block:,}) or kv_cache_memory")
        capacity = self.num_blocks * self.block_size
        if given_len is None:
            self.max_model_len = min(self.max_model_len, capacity)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 512 if self.enable_chunked_prefill else self.max_model_len
            self.chosen["max_num_batched_tokens"] = "the CPU default" if self.enable_chunked_prefill else \
                "max_model_len (no chunked prefill)"
        if given_len is not None and given_len > capacity and self.sliding_window is not None:
            if self.window_blocks(given_len) > self.num_blocks:  # a window bounds what a request holds
                raise ValueError(
                    f"num_blocks={self.num_blocks} x block_size={self.block_size} holds {capacity:,} tokens; a request "
                    f"of max_model_len={given_len:,} with sliding_window={self.sliding_window} and sink_tokens="
                    f"{self.sink_tokens} holds up to {self.window_blocks(given_len)} blocks at once (its sinks, its "
                    "window and one step's new tokens); raise num_blocks, or lower max_num_batched_tokens")
        elif given_len is not None and given_len > capacity:
            raise ValueError(
                f"num_blocks={self.num_blocks} x block_size={self.block_size} holds {capacity:,} tokens, too small "
                f"for one request of max_model_len={given_len:,}; raise num_blocks (or kv_cache_memory) to at least "
                f"{-(-given_len // self.block_size)}, or lower max_model_len")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit one step. Raise "
                "max_num_batched_tokens, lower max_model_len, or set enable_chunked_prefill=True")
        if self.swap_blocks is None:
            self.swap_blocks = self.num_blocks
        self._fit_offload(bytes_per_block)

    def _fit_offload(self, bytes_per_block: int) -> None:
        from minikv.cache.tiers.block_file import file_bytes
        from minikv.cache.tiers.disk_budget import DEFAULT_DISK_BYTES

        if self.kv_offload_cpu_bytes is not None and self.kv_offload_cpu_bytes < bytes_per_block:
            raise ValueError(f"kv_offload_cpu_bytes={self.kv_offload_cpu_bytes:,} holds no block of "
                             f"{bytes_per_block:,} bytes (block_size {self.block_size}); give at least "
                             f"{bytes_per_block:,}")
        if self.kv_offload_dir is not None:
            if self.kv_offload_disk_bytes is None:
                self.kv_offload_disk_bytes = DEFAULT_DISK_BYTES
            if self.kv_offload_disk_bytes < file_bytes(bytes_per_block):
                raise ValueError(f"kv_offload_disk_bytes={self.kv_offload_disk_bytes:,} holds no block file of "
                                 f"{file_bytes(bytes_per_block):,} bytes (block_size {self.block_size}); give at "
                                 f"least {file_bytes(bytes_per_block):,}")


# ---- the frozen config: nested parts, each option in one of them -----------------------------------
@dataclass(frozen=True)
class PoolConfig:
    """The paged pool (rungs 4-8): its blocks, what they store, the swap space, the sliding window."""

    block_size: int
    num_blocks: int | None
    kv_cache_memory: int | None
    kv_layout: str | None
    kv_cache_dtype: str
    swap_blocks: int | None
    sliding_window: int | None
    sink_tokens: int


@dataclass(frozen=True)
class SchedulingConfig:
    """Who runs each step (rungs 5 and 10)."""

    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool
    preemption: str
    schedule_policy: str


@dataclass(frozen=True)
class PrefixConfig:
    """Prefix caching (rung 6)."""

    prefix_caching: Any
    eviction: str


@dataclass(frozen=True)
class OffloadConfig:
    """The tiers below the prefix cache (rung 9)."""

    kv_offload_cpu_bytes: int | None
    kv_offload_dir: Any
    kv_offload_disk_bytes: int | None


@dataclass(frozen=True)
class ExecutionConfig:
    """Where and how steps run: the device, the dtype, the kernels, CUDA graphs, overlapped steps."""

    device: torch.device
    dtype: torch.dtype
    attention: str
    fused_ops: bool
    cuda_graphs: bool
    cuda_graph_max_tokens: int
    async_scheduling: bool
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 60.0


@dataclass(frozen=True)
class Seams:
    """The learner's code plugged into the engine, one named seam each (None: the engine's own)."""

    block_allocator: Any = None
    slot_mapping: Callable | None = None
    causal_attention: Callable | None = None
    decode_step: Callable | None = None
    schedule_step: Callable | None = None
    copy_on_write: Callable | None = None
    decode_inner_loop: Any = None
    window_free_rule: Callable | None = None
    kv_quantizer: Callable | None = None
    pick_next: Callable | None = None
    kv_offload_store: Any = None
    radix_insert: Callable | None = None
    radix_evict_leaf: Callable | None = None
    free_block_queue: Any = None
    spec_rollback: Callable | None = None
    shard_heads: Callable | None = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (rung 11)."""

    speculative: str | None
    num_speculative_tokens: int | None
    draft_model: Any
    speculative_disable_by_batch_size: int | None


PARTS: dict[str, type] = {"pool": PoolConfig, "scheduling": SchedulingConfig, "prefix": PrefixConfig,
                          "offload": OffloadConfig, "execution": ExecutionConfig, "seams": Seams,
                          "speculation": SpeculativeConfig}
TOP_LEVEL = ("model", "kv_backend", "max_model_len", "seed")
OPTIONS = TOP_LEVEL + tuple(f.name for part in PARTS.values() for f in fields(part))  # what LLM(...) takes


@dataclass(frozen=True)
class EngineConfig:
    """Every option of the engine, checked and frozen, in nested parts:

        cfg.pool.block_size   cfg.scheduling.max_num_seqs   cfg.prefix.prefix_caching
        cfg.offload.kv_offload_dir   cfg.execution.device   cfg.seams.copy_on_write

    Each option also reads flat (`cfg.block_size is cfg.pool.block_size`). Build one with
    `EngineConfig.from_options(**options)` (the keywords of `LLM(...)`, each checked); `fit(...)`
    returns a new config with every size resolved against the model and the machine, and `chosen`
    saying which sizes it picked itself and why. A config is never changed in place."""

    model: Any
    kv_backend: str
    max_model_len: int | None
    seed: int
    pool: PoolConfig
    scheduling: SchedulingConfig
    prefix: PrefixConfig
    offload: OffloadConfig
    execution: ExecutionConfig
    seams: Seams
    speculation: SpeculativeConfig
    fitted: bool = False  # sizes resolved by fit()
    chosen: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), repr=False)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """The options of `LLM(...)`, each checked on its own and against the others. An unknown
        keyword is a ValueError with the nearest known one ("did you mean ...")."""
        unknown = [k for k in options if k not in OPTIONS]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], OPTIONS, n=1)
            raise ValueError(f"LLM got an unknown option {unknown[0]!r}"
                             + (f"; did you mean {hint[0]!r}?" if hint else f"; options: {', '.join(OPTIONS)}"))
        return cls._freeze(_Draft(**options), fitted=False)

    @classmethod
    def _freeze(cls, d: _Draft, fitted: bool) -> "EngineConfig":
        parts = {name: part(**{f.name: getattr(d, f.name) for f in fields(part)}) for name, part in PARTS.items()}
        return cls(**{k: getattr(d, k) for k in TOP_LEVEL}, **parts, fitted=fitted,
                   chosen=MappingProxyType(dict(d.chosen)))

    def options(self) -> dict[str, Any]:
        """Every option, flat, as `LLM(...)` takes it (resolved values where resolved)."""
        out = {k: getattr(self, k) for k in TOP_LEVEL}
        for name in PARTS:
            part = getattr(self, name)
            out.update((f.name, getattr(part, f.name)) for f in fields(part))
        return out

    def _draft(self) -> _Draft:
        return _Draft(**self.options())

    def fit(self, max_positions: int, bytes_per_block: int | None = None, model_window: int | None = None,
            shape: ScratchShape | None = None, info: DeviceInfo | None = None) -> "EngineConfig":
        """A new config with the sizes left as None filled in and checked against the model and the
        machine (see `_Draft.fit`); this one is unchanged."""
        if self.fitted:
            raise ValueError("this config is fitted already (its sizes are resolved); fit the config that "
                             "EngineConfig.from_options returned")
        d = self._draft()
        d.fit(max_positions, bytes_per_block, model_window, shape, info)
        return self._freeze(d, fitted=True)

    @property
    def is_paged(self) -> bool:
        return self.kv_backend == "paged"

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype the paged pool stores K/V in (kv_cache_dtype resolved against the model's dtype)."""
        from minikv.cache.blocks.quant import cache_dtype

        return cache_dtype(self.kv_cache_dtype, self.dtype)

    @property
    def offloads(self) -> bool:
        return self.offload.kv_offload_cpu_bytes is not None or self.offload.kv_offload_dir is not None

    @property
    def uses_learner_attention(self) -> bool:
        return self.seams.causal_attention is not None or self.seams.decode_step is not None

    def window_blocks(self, num_tokens: int) -> int:
        return _Draft.window_blocks(self, num_tokens)


def _flat(part: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, part), name), doc=f"= cfg.{part}.{name}")


for _part, _cls in PARTS.items():
    for _f in fields(_cls):
        setattr(EngineConfig, _f.name, _flat(_part, _f.name))
