"""Every option of the engine in one object, checked in one place.

    LLM("smollm2-135m", kv_backend="paged", block_size=16)   ->   EngineConfig(...)   (checked at once)
                                                             ->   config.fit(model)   (sizes that need the model)

Two phases, because some limits are only known once the weights are loaded:

    __post_init__   every option on its own and the options against each other: types, ranges, which
                    options belong to which rung (a block size means nothing without a paged pool)
    fit(model)      the options against the model and the machine: max_model_len against the model's
                    positions, the pool's size in blocks against memory, the token budget against
                    max_model_len. Fills in every size left as None.

Every error names the option, the value it got, the limit, and the fix.

The named seams (where a learner's code enters the engine) are options too, checked here like the
others: a seam given to a rung that does not use it is an error, never silently ignored.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

KV_BACKENDS = ("naive", "contiguous", "paged")
ATTENTION_IMPLS = ("torch", "triton")
KV_LAYOUTS = ("nhd", "hnd")
PREEMPTION_MODES = ("recompute", "swap")
PREFIX_CACHING = ("hash", "radix")
EVICTION_POLICIES = ("lru", "fifo")
SCHEDULE_POLICIES = ("fcfs", "lpm")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
          "float": torch.float32}
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 4, 1024
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = {"naive": 1, "contiguous": 4, "paged": 32}
DEFAULT_CPU_KV_MEMORY = 256 * 2**20  # bytes of paged pool on a CPU when neither num_blocks nor kv_cache_memory is given
DEFAULT_GPU_KV_FRACTION = 0.5  # of the free device memory at start-up

# seam -> (the rung it belongs to, a predicate on the config, what to do instead)
SEAMS: dict[str, tuple[str, Callable[["EngineConfig"], bool], str]] = {
    "causal_attention": ("rung 1", lambda c: c.kv_backend == "naive", "kv_backend='naive'"),
    "decode_step": ("rung 2", lambda c: c.kv_backend == "contiguous", "kv_backend='contiguous'"),
    "slot_mapping": ("rung 4", lambda c: c.is_paged, "kv_backend='paged'"),
    "schedule_step": ("rung 5", lambda c: c.is_paged and c.prefix_caching is None,
                      "kv_backend='paged' with prefix_caching=None (the exercise's scheduler does not match prefixes)"),
    "copy_on_write": ("rung 6", lambda c: c.is_paged, "kv_backend='paged'"),
    "decode_inner_loop": ("rung 7", lambda c: c.attention == "triton", "kv_backend='paged', attention='triton'"),
    "kv_offload_store": ("rung 9", lambda c: c.is_paged and _is_hash_chain(c.prefix_caching),
                         "kv_backend='paged', prefix_caching='hash'"),
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
class EngineConfig:
    """The options of `LLM(...)`; see `LLM.__init__` for what each one means."""

    model: Any = "smollm2-135m"
    device: Any = None
    dtype: Any = None
    kv_backend: str = "contiguous"
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
    # prefix caching (rung 6)
    prefix_caching: Any = None
    eviction: str = "lru"
    schedule_policy: str = "fcfs"
    # named seams: a learner's code plugged into the engine
    block_allocator: Any = None
    slot_mapping: Callable | None = None
    causal_attention: Callable | None = None
    decode_step: Callable | None = None
    schedule_step: Callable | None = None
    copy_on_write: Callable | None = None
    decode_inner_loop: Any = None
    # offload tiers below the prefix cache (rung 9)
    kv_offload_cpu_bytes: int | None = None
    kv_offload_dir: Any = None
    kv_offload_disk_bytes: int | None = None
    kv_offload_store: Any = None  # the rung-9 seam: a BlockStore (put, get, in) or a function making one

    @property
    def is_paged(self) -> bool:
        return self.kv_backend == "paged"

    def __post_init__(self) -> None:
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
        self._check_paged_options()
        self._check_prefix_options()
        self._check_offload_options()
        self._check_seams()
        if self.attention == "triton" and self.device.type != "cuda" and self.dtype == torch.bfloat16:
            raise ValueError("the Triton kernels run in the interpreter on a CPU, whose bfloat16 arithmetic is "
                             "wrong; use dtype float32 or float16 there (bfloat16 is fine on a GPU)")
        if self.cuda_graphs is None:
            self.cuda_graphs = self.device.type == "cuda" and self.attention == "triton"
        elif self.cuda_graphs and (self.device.type != "cuda" or self.attention != "triton"):
            raise ValueError(f"cuda_graphs replays decode steps of the Triton kernels on a GPU (here: device "
                             f"{self.device.type}, attention {self.attention!r}, kv_backend {self.kv_backend!r}); "
                             "use kv_backend='paged', attention='triton' on a CUDA device, or cuda_graphs=False")

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
        if self.is_paged and self.kv_layout is None:
            self.kv_layout = "hnd" if self.attention == "triton" else "nhd"

    def _check_prefix_options(self) -> None:
        from minikv.cache.prefix_cache import PrefixCache

        p = self.prefix_caching
        if p is not None and not isinstance(p, PrefixCache):
            _check_choice("prefix_caching", p, PREFIX_CACHING, allow_none=True)
        self._paged_only("prefix_caching", p is not None)
        _check_choice("eviction", self.eviction, EVICTION_POLICIES)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
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
                raise ValueError(f"{name} must be a function (the {rung} seam), got {type(fn).__name__} {fn!r}")
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

    @property
    def uses_learner_attention(self) -> bool:
        return self.causal_attention is not None or self.decode_step is not None

    # ---- phase 2: against the model and the machine ------------------------------------------------
    def fit(self, max_positions: int, bytes_per_block: int | None = None) -> None:
        """Fill in the sizes left as None and check them against the model (its number of positions)
        and, for a paged pool, against memory (`bytes_per_block`: K and V of one block, all layers)."""
        if self.max_model_len is not None and self.max_model_len > max_positions:
            raise ValueError(f"max_model_len {self.max_model_len:,} exceeds the model's {max_positions:,} positions; "
                             "lower it")
        given_len = self.max_model_len
        if self.max_model_len is None:
            self.max_model_len = min(max_positions, DEFAULT_MAX_MODEL_LEN)
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS[self.kv_backend]
        if not self.is_paged:
            return
        assert bytes_per_block is not None, "a paged config is fitted with the pool's bytes per block"
        available = memory_available(self.device)
        if self.num_blocks is None:
            memory = self.kv_cache_memory
            if memory is None:
                memory = (int(available * DEFAULT_GPU_KV_FRACTION) if self.device.type == "cuda"
                          else DEFAULT_CPU_KV_MEMORY)
            self.num_blocks = memory // bytes_per_block
            if self.num_blocks < 1:
                raise ValueError(f"kv_cache_memory={memory:,} bytes holds no block of {bytes_per_block:,} bytes "
                                 f"(block_size {self.block_size}); give more memory or a smaller block_size")
        need = self.num_blocks * bytes_per_block
        if need > available:
            raise ValueError(f"num_blocks={self.num_blocks:,} blocks of {bytes_per_block:,} bytes need "
                             f"{need / 2**30:,.1f} GiB but the {self.device.type} has {available / 2**30:,.1f} GiB; "
                             f"lower num_blocks (at most {available // bytes_per_block:,}) or kv_cache_memory")
        capacity = self.num_blocks * self.block_size
        if given_len is None:
            self.max_model_len = min(self.max_model_len, capacity)
        elif given_len > capacity:
            raise ValueError(
                f"num_blocks={self.num_blocks} x block_size={self.block_size} holds {capacity:,} tokens, too small "
                f"for one request of max_model_len={given_len:,}; raise num_blocks (or kv_cache_memory) to at least "
                f"{-(-given_len // self.block_size)}, or lower max_model_len")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 512 if self.enable_chunked_prefill else self.max_model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit one step. Raise "
                "max_num_batched_tokens, lower max_model_len, or set enable_chunked_prefill=True")
        if self.swap_blocks is None:
            self.swap_blocks = self.num_blocks
        self._fit_offload(bytes_per_block)

    def _fit_offload(self, bytes_per_block: int) -> None:
        from minikv.cache.tiers import DEFAULT_DISK_BYTES, file_bytes

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
