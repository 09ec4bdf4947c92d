"""The public face of the engine: `LLM(model, ...)`, `generate`, `stream`.

    llm = LLM("smollm2-135m", kv_backend="contiguous")
    out = llm.generate(["The KV cache is"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].time_to_first_token)

One engine step = schedule -> prepare one flattened batch -> model -> sample -> update.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import threading
import weakref
from collections import deque
from typing import Callable, Iterator

import numpy as np
import torch

from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.naive import NaiveBackend
from minikv.attention.paged import PagedBackend
from minikv.attention.seams import CausalAttentionSeam, DecodeStepSeam
from minikv.cache.block_manager import BlockManager
from minikv.cache.blocks.block_table import blocks_needed
from minikv.cache.blocks.pool import KVPool, RowPool
from minikv.cache.blocks.swap import SwapSpace

from minikv.cache.prefix.base import PrefixCache
from minikv.cache.prefix.registry import make_prefix_cache
from minikv.cache.tiers.cpu import CpuTier
from minikv.cache.tiers.disk import DiskTier
from minikv.cache.tiers.identity import store_identity, weights_fingerprint
from minikv.cache.tiers.offload import Offload
from minikv.cache.tiers.tiered import TieredStore
from minikv.engine.batch import ScheduledBatch
from minikv.engine.beam import BeamSearch, take_beam_rows
from minikv.engine.config import EngineConfig, ScratchShape
from minikv.engine.cuda_graph import DecodeGraphs
from minikv.engine.detokenizer import detokenize, flush
from minikv.engine.fair import VirtualTokenCounter
from minikv.engine.fork import clone, fork_samples, new_seed, sample_seed, samples_of
from minikv.engine.gc_pause import frozen_heap
from minikv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent
from minikv.engine.overlap import PLACEHOLDER, InFlight, min_free_blocks, without_finished
from minikv.engine.prompts import is_single_prompt, parse_prompt
from minikv.engine.runner import ModelRunner
from minikv.engine.sampler import draw_keys, sample, sample_on_device
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus
from minikv.engine.simple_scheduler import SimpleScheduler
from minikv.model.loader import LoadedModel, load_model

Prompt = str | list[int] | dict
CLOSED_MESSAGE = "the engine is closed (close() or the end of its `with` block); build a new LLM"


def pair_requests(prompts, params) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or a list of them, with one SamplingParams for all or one each -> two equal lists."""
    if is_single_prompt(prompts):
        prompts = [prompts]
    if not isinstance(prompts, list):
        raise ValueError(f"prompts must be a prompt (text, a list of token ids, a dict) or a list of prompts, "
                         f"got {type(prompts).__name__} {prompts!r}")
    if not prompts:
        raise ValueError("no prompts given")
    params = params if params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("params must be a SamplingParams or a list of them, one per prompt (build each with "
                         f"SamplingParams(...), not a dict); got {params!r}")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; give one, or one per prompt")
    return list(prompts), list(params)


def _done(seq: Sequence) -> bool:
    """Every sample of the request seq started has finished (forks still to come count as unfinished)."""
    return not seq.num_pending_forks and all(s.is_finished for s in samples_of(seq))


def _keys(seqs: list[Sequence]) -> np.ndarray:
    """The draw keys of these sequences, int64 (greedy ones draw nothing: 0)."""
    keys = draw_keys([s.seed for s in seqs], [len(s.output_token_ids) for s in seqs])
    keys[[i for i, s in enumerate(seqs) if s.params.greedy]] = 0
    return keys


_said: set[str] = set()
PROGRESS_MIN_REQUESTS = 16  # generate() shows a progress bar from this many requests on (on a terminal)


def _show_progress(num_requests: int, use_tqdm: bool | None) -> bool:
    if use_tqdm is not None:
        if not isinstance(use_tqdm, bool):
            raise ValueError(f"use_tqdm must be True, False or None (a bar for many requests on a terminal), "
                             f"got {use_tqdm!r}")
        return use_tqdm
    return num_requests >= PROGRESS_MIN_REQUESTS and sys.stderr.isatty()


class Progress:
    """A tqdm bar over the requests of one generate call: requests done, and output tokens per second."""

    def __init__(self, seqs: list[Sequence]):
        import time

        from tqdm import tqdm

        self.clock = time.perf_counter
        self.left = [s.params.n for s in seqs]  # samples of each request still running
        self.tokens, self.start, self.shown = 0, self.clock(), 0.0
        self.bar = tqdm(total=len(seqs), desc="generate", unit="req", file=sys.stderr, dynamic_ncols=True)

    def see(self, event: StreamEvent) -> None:
        self.tokens += event.token_id is not None
        if event.finished:
            self.left[event.index] -= 1
            if self.left[event.index] == 0:
                self.bar.update(1)
        now = self.clock()
        if now - self.shown > 0.5 or event.finished:
            self.shown = now
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.start, 1e-9):,.0f} tok/s", refresh=False)

    def close(self) -> None:
        self.bar.set_postfix_str(f"{self.tokens / max(self.clock() - self.start, 1e-9):,.0f} tok/s", refresh=False)
        self.bar.close()


def _say_once(message: str) -> None:
    """Print a line to stderr the first time it comes up in this process."""
    if message not in _said:
        _said.add(message)
        print(message, file=sys.stderr)


def _weakly(method: Callable) -> Callable:
    """A callback to a bound method that does not keep its object alive: the parts an engine owns (its
    scheduler) call back into it without making a cycle, so `del llm` frees the engine at once."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        fn = ref()
        if fn is not None:
            fn(*args)
    return call


def _given(**kwargs) -> dict:
    """The keyword arguments that were given (not None): seams reach the parts that take them only when used."""
    return {k: v for k, v in kwargs.items() if v is not None}


class LLM:
    def __init__(self, model: str = "smollm2-135m", device: str | None = None, dtype: torch.dtype | str | None = None,
                 kv_backend: str | None = None, max_model_len: int | None = None, max_num_seqs: int | None = None,
                 seed: int = 0, **options):
        """kv_backend: "naive" (rung 1), "contiguous" (rung 2) or "paged" (rungs 4-7); None: paged on a
        GPU, contiguous on a CPU. Every option is checked at once by `EngineConfig`
        (minikv/engine/config.py), which also fills in the defaults: on a GPU, max_num_seqs, the token
        budget and the pool's size are fitted to the card and the model (printed once, and in stats()).

        Paged pool: block_size (tokens per block, a power of two), num_blocks or kv_cache_memory
        (bytes) for the pool, max_num_batched_tokens (token budget per step), enable_chunked_prefill,
        preemption ("recompute" or "swap"), swap_blocks (CPU swap space, default num_blocks),
        attention ("torch" reference or "triton" kernels; default "triton" for a paged pool on a GPU,
        "torch" otherwise), kv_layout (the pool's storage order: "nhd" token-major or "hnd"
        head-major; default the attention's own), cuda_graphs (decode steps replayed from CUDA graphs;
        default on with Triton attention on a GPU, see minikv/engine/cuda_graph.py), kv_cache_dtype (what
        the pool stores: "auto" the model's dtype, "int8" or "fp8" e4m3 with a float32 scale per token
        and KV head, and for int8 a zero point, about half the bytes of a 16-bit pool; see minikv/cache/quant.py),
        async_scheduling (the host schedules and prepares step t+1 while the device runs step t; None:
        on for a paged engine on a GPU, off on a CPU, where True still runs the same code path; see
        minikv/engine/overlap.py).

        Model: fused_ops (each layer's residual adds, RMSNorms, rotary embedding and SiLU-and-mul as
        Triton kernels, q/k/v and gate/up as one matmul each; default on a GPU, off on a CPU, where the
        torch model is the reference; see minikv/model/llama.py).

        Prefix caching (rung 6, paged): prefix_caching None, "hash" (vLLM's hashed block chain), "radix"
        (SGLang's radix tree) or a PrefixCache; eviction "lru" or "fifo"; schedule_policy "fcfs",
        "lpm" (longest cached prefix first) or "vtc" (fair between tenants: the tenant with the least
        service so far goes first, minikv/engine/fair.py). Requests with different `cache_salt` never
        share blocks.

        Offload tiers (rung 9, prefix_caching="hash"): kv_offload_cpu_bytes (blocks evicted from the pool
        wait in CPU memory, LRU within this budget), kv_offload_dir (and kv_offload_disk_bytes, default
        1 GiB, a budget for the whole directory: engines sharing it keep to it together): blocks are
        also written to files there as they are cached, and a later engine of the same model finds them. A lookup that misses the pool copies stored blocks back. Call `close()`
        (or use `with LLM(...) as llm:`) to finish the disk writes. See minikv/cache/tiers.py.

        Named seams, where your own code runs inside the engine (each exercise plugs into one):
            causal_attention=fn   rung 1  attention of one whole sequence (kv_backend="naive")
            decode_step=fn        rung 2  one decode step on a contiguous cache row (kv_backend="contiguous")
            block_allocator=cls   rung 4  hands out and takes back block ids
            slot_mapping=fn       rung 4  physical slot of each new token
            schedule_step=fn      rung 5  which sequences run this step, and how many tokens each
            copy_on_write=fn      rung 6  private copies of the shared blocks a step writes into
            decode_inner_loop=fn  rung 7  the Triton decode kernel's online-softmax step
            window_free_rule=fn   rung 8  which blocks a sliding window gives back (needs sliding_window)
            kv_quantizer=fn       rung 8  quantizes K/V rows (with their scales) as the pool stores them
            kv_offload_store=obj  rung 9  keeps the blocks the pool evicts (put, get, in)
            pick_next=fn          rung 10 which waiting request the fair scheduler admits next
        Views and checkers watch the engine through `add_observer`.

        Sliding window (rung 8, paged): sliding_window=W, sink_tokens=S: each query sees the first S
        and the last W positions (StreamingLLM), and blocks outside every later window go back to
        the pool while the request runs (minikv/cache/window.py). None: the model's own window, if
        its config has one (Mistral); a window on a model trained without one changes its outputs.
        """
        try:
            cfg = EngineConfig(model=model, device=device, dtype=dtype, kv_backend=kv_backend,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, **options)
        except TypeError as e:  # an unknown keyword
            known = [f.name for f in dataclasses.fields(EngineConfig)]
            unknown = [k for k in options if k not in known]
            if not unknown:
                raise
            hint = difflib.get_close_matches(unknown[0], known, n=1)
            raise ValueError(f"LLM got an unknown option {unknown[0]!r}"
                             + (f"; did you mean {hint[0]!r}?" if hint else f"; options: {', '.join(known)}")) from e
        self.engine_config = cfg
        self.device, self.dtype, self.kv_backend, self.seed = cfg.device, cfg.dtype, cfg.kv_backend, cfg.seed
        self._options = dict(device=device, dtype=dtype, kv_backend=kv_backend, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, seed=seed, **options)
        if isinstance(model, LoadedModel):  # the weights of another engine (see derive)
            weight = next(model.model.parameters())
            if (weight.device.type, weight.dtype) != (self.device.type, self.dtype):
                raise ValueError(f"the loaded weights are {weight.dtype} on {weight.device}, the engine asks for "
                                 f"{self.dtype} on {self.device}; derive an engine with the same device and dtype")
            loaded = model
        else:
            if not isinstance(model, str):
                raise ValueError(f"model must be a name ('tiny-random', 'smollm2-135m'), a checkpoint directory, "
                                 f"a .gguf file or a hub id, got {type(model).__name__} {model!r}")
            loaded = load_model(model, self.device, self.dtype)
        self.loaded = loaded
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model.fused_ops = cfg.fused_ops  # before any CUDA graph records the model
        c = self.config
        if self.device.type == "cuda":  # what a closed or deleted engine left in PyTorch's cache counts as free
            torch.cuda.empty_cache()
        cfg.fit(c.max_position_embeddings,
                KVPool.bytes_per_block(c.num_layers, cfg.block_size, c.num_kv_heads, c.head_dim, cfg.kv_dtype),
                c.sliding_window, ScratchShape(c.hidden_size, c.intermediate_size, c.vocab_size, self.dtype.itemsize))
        if cfg.chosen and self.device.type == "cuda":
            _say_once(f"minikv: {cfg.kv_backend} engine fitted to the device: "
                      + ", ".join(f"{name}={getattr(cfg, name):,}" for name in cfg.chosen)
                      + " (pass any of them to LLM(...) to override)")
        self.max_model_len = cfg.max_model_len
        self.attention = cfg.attention if cfg.is_paged else None
        self.block_size = cfg.block_size if cfg.is_paged else None
        self.eos_token_ids = set(c.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self.prefix_cache: PrefixCache | None = None
        self.block_manager: BlockManager | None = None
        self.offload_store = None  # rung 9: where blocks the pool evicts go (CPU memory, disk, or yours)
        self._closed = False
        self._last: list[Sequence] = []  # the requests of the last generate / stream / beam_search (stats)
        self._observers: list = []
        self._lock = threading.RLock()  # one step at a time, whichever thread or loop drives the engine
        self._listeners: dict[int, tuple[deque, int]] = {}  # root seq_id -> (its stream's events, prompt index)
        self._requests: dict[int, Sequence] = {}  # root seq_id -> every request not done yet (for _recover)
        self._reset_pending = False
        self._async_scheduling = cfg.async_scheduling
        self._inflight: InFlight | None = None  # the overlapped step launched but not yet read back
        self._placeholders: list[Sequence] = []  # sequences whose last token is a PLACEHOLDER right now
        self.num_overlapped_steps = 0  # steps launched while the previous one still ran on the device
        self._token_host = torch.empty(0, dtype=torch.long)  # pinned: where sampled ids land (GPU, overlapped)
        {"naive": self._build_naive, "contiguous": self._build_contiguous, "paged": self._build_paged}[cfg.kv_backend](cfg)
        graphs = None
        if cfg.cuda_graphs:
            graphs = DecodeGraphs(self.model, self.backend, self.device, self.block_size, cfg.max_num_seqs,
                                  self.max_model_len, c.vocab_size)
            with torch.inference_mode():
                graphs.capture_all()
        self.runner = ModelRunner(self.model, self.backend, self.device, self.block_size, graphs,
                                  **_given(slot_mapping=cfg.slot_mapping))

    # ---- one builder per rung -------------------------------------------------------------------
    def _build_naive(self, cfg: EngineConfig) -> None:
        """Rung 1: no cache; every step feeds the whole sequence again."""
        if cfg.causal_attention is not None:
            self.backend = CausalAttentionSeam(cfg.causal_attention)
        else:
            self.backend = NaiveBackend(self.config.sliding_window)
        self.scheduler = SimpleScheduler(None, cfg.max_num_seqs)

    def _build_contiguous(self, cfg: EngineConfig) -> None:
        """Rung 2: one preallocated row of max_model_len positions per running request."""
        c = self.config
        rows = RowPool(c.num_layers, cfg.max_num_seqs, self.max_model_len, c.num_kv_heads, c.head_dim, self.dtype,
                       self.device)
        self.backend = ContiguousBackend(rows, c.sliding_window)
        if cfg.decode_step is not None:
            self.backend = DecodeStepSeam(self.backend, cfg.decode_step)
        self.scheduler = SimpleScheduler(rows, cfg.max_num_seqs)

    def _build_paged(self, cfg: EngineConfig) -> None:
        """Rungs 4-7: a block pool, block tables, a continuous-batching scheduler, optionally a prefix cache."""
        c = self.config
        if cfg.attention == "triton":
            from minikv.attention.triton_backend import TritonPagedBackend as backend_cls
            extra = _given(decode_inner_loop=cfg.decode_inner_loop)
        else:
            backend_cls, extra = PagedBackend, {}
        pool = KVPool(c.num_layers, cfg.num_blocks, cfg.block_size, c.num_kv_heads, c.head_dim, self.dtype,
                      self.device, cfg.kv_layout, cfg.kv_dtype, cfg.kv_quantizer)
        self.backend = backend_cls(pool, cfg.sliding_window, cfg.sink_tokens, **extra)
        self.offload_store = self._new_offload_store(cfg, pool)
        self.block_manager, self.prefix_cache = self._new_block_manager(cfg)
        swap = SwapSpace(pool, cfg.swap_blocks) if cfg.preemption == "swap" else None
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   cfg.enable_chunked_prefill, cfg.preemption, swap,
                                   **_given(schedule_step=cfg.schedule_step), on_event=_weakly(self._on_event))
        if cfg.prefix_caching is not None:
            self.scheduler.policy = cfg.schedule_policy
        if cfg.schedule_policy == "vtc":
            self.scheduler.fair = VirtualTokenCounter(cfg.pick_next)

    def _new_block_manager(self, cfg: EngineConfig) -> tuple[BlockManager, PrefixCache | None]:
        """Block tables and refcounts over the allocator, with the prefix cache attached; all empty. Called
        at start-up and again after a fault (a learner's allocator class or cache is built anew)."""
        allocator = cfg.block_allocator
        if allocator is not None and not isinstance(allocator, type):
            if self.block_manager is None:
                allocator_obj = allocator  # the instance given, used as it is the first time
            else:
                allocator_obj = type(allocator)(cfg.num_blocks)
        else:
            allocator_obj = allocator(cfg.num_blocks) if allocator is not None else None
        bm = BlockManager(cfg.num_blocks, cfg.block_size, allocator_obj, **_given(copy_on_write=cfg.copy_on_write),
                          sliding_window=cfg.sliding_window, sink_tokens=cfg.sink_tokens,
                          **_given(free_rule=cfg.window_free_rule))
        cache = None
        if cfg.prefix_caching is not None:
            design = cfg.prefix_caching
            if isinstance(design, PrefixCache) and self.block_manager is not None:
                design = type(design)(design.block_size, design.eviction)
            cache = make_prefix_cache(design, cfg.block_size, cfg.eviction)
            bm.attach_prefix_cache(cache)
            if self.offload_store is not None:
                bm.attach_offload(Offload(self.backend.pool, cache, self.offload_store, self._offload_identity))
        return bm, cache

    def _new_offload_store(self, cfg: EngineConfig, pool: KVPool):
        """The store below the prefix cache (rung 9): the engine's CPU / disk tiers, a learner's store
        (the kv_offload_store seam), or None."""
        if not cfg.offloads and cfg.kv_offload_store is None:
            return None
        self._offload_identity = store_identity(self._weights_fingerprint(), self.dtype, pool)
        if cfg.kv_offload_store is not None:
            store = cfg.kv_offload_store
            return store if hasattr(store, "put") else store()
        return TieredStore(self._new_cpu_tier(cfg, pool), self._new_disk_tier(cfg, pool))

    def _new_cpu_tier(self, cfg: EngineConfig, pool: KVPool) -> CpuTier | None:
        if cfg.kv_offload_cpu_bytes is None:
            return None
        return CpuTier(cfg.kv_offload_cpu_bytes, pool.block_bytes, pin=self.device.type == "cuda")

    def _new_disk_tier(self, cfg: EngineConfig, pool: KVPool) -> DiskTier | None:
        if cfg.kv_offload_dir is None:
            return None
        disk = DiskTier(cfg.kv_offload_dir, self._offload_identity, cfg.kv_offload_disk_bytes, pool.block_bytes)
        weakref.finalize(self, disk.close)  # an engine dropped without close() still finishes its writes
        return disk

    def _weights_fingerprint(self, fresh: bool = False) -> str:
        """sha256 of every weight, taken again whenever the weights moved since the last time (an
        engine derived after an in-place change gets a new identity; see tiers.weights_fingerprint),
        and always after a reset."""
        return weights_fingerprint(self.model, fresh)

    def close(self) -> None:
        """Abort every request not finished yet (finish reason "abort": a stream of one gets its last
        event), queue the cached blocks not yet written through, finish the offload tiers' disk writes
        and stop the writer thread, then give back the memory the engine allocated: the KV pool, the
        swap space, the CPU tier, the CUDA graphs and staging buffers (on a GPU, to the driver too, so
        that the next engine sized from free memory sees it). Afterwards `step()`, `generate()` and
        `add_request()` raise CLOSED_MESSAGE. Idempotent; `with LLM(...) as llm:` calls it on leaving.

        The weights stay (`llm.loaded`: `derive()` still builds engines on them); they go with the
        engine (`del llm`: nothing in it holds a cycle back to it) unless another engine shares them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # first: a request submitted from now on is refused
            for seq in list(self._requests.values()):
                self.abort(seq)
            self._drain()  # an overlapped step still on the device: wait for it, give its blocks back
            offload = self.block_manager.offload if self.block_manager is not None else None
            if offload is not None:
                offload.close()  # cached blocks queued for write-through go to the store before it closes
            if isinstance(self.offload_store, TieredStore):
                self.offload_store.close()
            self._release_memory()

    def _release_memory(self) -> None:
        """Every tensor the engine allocated goes (the objects stay, empty, so stats() still answers)."""
        pool = getattr(self.backend, "pool", None)  # KVPool (paged), RowPool (contiguous), none (naive)
        if pool is not None:
            pool.close()
        swap = getattr(self.scheduler, "swap", None)
        if swap is not None:
            swap.close()
        self.runner.close()
        self._token_host = torch.empty(0, dtype=torch.long)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def async_scheduling(self) -> bool:
        """Whether steps overlap (minikv/engine/overlap.py). It may be switched on a running engine:
        the step in flight, if any, is finished first."""
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise ValueError(f"async_scheduling must be True or False, got {on!r}")
        if on and not self.is_paged:
            raise ValueError(f"async_scheduling overlaps the steps of the paged engine, not {self.kv_backend!r}")
        with self._lock:
            self._drain()
            self._async_scheduling = on

    @property
    def is_paged(self) -> bool:
        """A paged pool (rungs 4-7): block tables, the block manager, prefix caching, forks."""
        return self.engine_config.is_paged

    def derive(self, **changes) -> "LLM":
        """A new engine on the same loaded weights, with the same options except `changes`. This is how a
        checker runs your function beside the engine's own:

            mine = llm.derive(slot_mapping=my_slot_mapping)   # = LLM(same model, same options, slot_mapping=...)
        """
        return LLM(self.loaded, **{**self._options, **changes})

    # ---- observers ------------------------------------------------------------------------------
    def add_observer(self, observer) -> Callable[[], None]:
        """Watch every step: `observer.on_schedule(llm, batch)` once the scheduler picked the batch (before
        the model runs), `observer.on_step(llm, batch, events)` once the step is done, and
        `observer.on_event(llm, step, request_id, event)` for each scheduler event of a paged engine
        (arrive, load, admit, preempt, swap_out, swap_in, fork, finish, abort); any may be missing. Views and
        checkers use this instead of wrapping engine methods. Returns `remove()`."""
        if not any(hasattr(observer, hook) for hook in ("on_schedule", "on_step", "on_event")):
            raise ValueError("an observer needs an on_schedule(llm, batch), on_step(llm, batch, events) or "
                             "on_event(llm, step, request_id, event) method")
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def _on_event(self, step: int, request_id: str, event: str) -> None:
        """The scheduler's events (arrive, load, admit, preempt, swap_out, swap_in, fork, finish, abort) go to
        observers with an `on_event(llm, step, request_id, event)` method."""
        self._notify("on_event", step, request_id, event)

    def _notify(self, hook: str, *args) -> None:
        for obs in list(self._observers):
            fn = getattr(obs, hook, None)
            if fn is not None:
                fn(self, *args)

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[list[int], str | None, str | None]:
        """Return (token ids, text or None, cache salt or None) of one prompt, validated."""
        ids, text, salt = parse_prompt(prompt, self.tokenizer, self.config.vocab_size)  # minikv/engine/prompts.py
        if len(ids) > self.max_model_len:
            if self.block_size is not None and self.max_model_len == self.block_manager.num_blocks * self.block_size:
                raise ValueError(
                    f"prompt has {len(ids):,} tokens but the KV pool holds only {self.max_model_len:,} "
                    f"({self.block_manager.num_blocks} blocks x {self.block_size}); it can never fit: raise "
                    "num_blocks or kv_cache_memory, or shorten the prompt")
            raise ValueError(f"prompt has {len(ids):,} tokens but max_model_len is {self.max_model_len:,}; "
                             "raise max_model_len or shorten the prompt")
        return ids, text, salt

    def chat_prompt(self, user_message: str, system: str | None = None) -> str:
        """Wrap a user message in the model's chat template (instruct models), ready to generate from."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return user_message
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    # ---- running -------------------------------------------------------------------------------
    def make_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        ids, text, salt = self.encode(prompt)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (or a list of them, one per prompt), "
                             f"got {type(params).__name__} {params!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} can never match: model {self.config.model_type!r} has no "
                             "tokenizer, so no text is produced; stop on token ids with EOS, or load a model with one")
        if self.is_paged:
            self._check_fits_beside_pins(ids, salt, params)
        seq = Sequence(ids, params, request_id=request_id, cache_salt=salt, prompt=text)
        seq.seed = params.seed if params.seed is not None else new_seed(self._generator)
        if params.n > 1:
            if self.is_paged:  # paged: prefill once, then fork (minikv/engine/fork.py)
                if params.n > self.scheduler.max_num_seqs:
                    raise ValueError(f"n={params.n} parallel samples run at once but max_num_seqs is "
                                     f"{self.scheduler.max_num_seqs}; raise max_num_seqs or lower n")
                seq.num_pending_forks = params.n - 1
            else:  # no blocks to share: n independent sequences, each prefilled on its own
                for i in range(1, params.n):
                    sample = clone(seq, i)
                    sample.seed = sample_seed(seq, i, self._generator)
                    seq.forks.append(sample)
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    tenant: str | None = None) -> Sequence:
        """Queue one request (validated now: a bad one raises and leaves the engine untouched).
        Drive the engine with `step()` until `has_unfinished()` is False. `tenant` names who sent it
        (schedule_policy="vtc" shares the engine fairly between tenants)."""
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {type(tenant).__name__} {tenant!r}")
        seq = self.make_sequence(prompt, params or SamplingParams(), request_id)
        seq.tenant = tenant
        with self._lock:
            self._requests[seq.seq_id] = seq
            for s in samples_of(seq):
                self.scheduler.add(s)
        return seq

    def has_unfinished(self) -> bool:
        """Requests still to run, or an overlapped step still on the device (its blocks still held)."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Yield a StreamEvent for every generated token of these requests, as the engine makes it.

        Every request's last event has `finished=True` (an aborted one: finish_reason "abort"). Each call
        gets exactly its own events, whoever drives the engine: calls from several threads share the
        engine one step at a time, and a `generate` called inside a `stream` loop runs the outer
        requests too, keeping their events for the outer loop."""
        yield from self._follow(*self._submit(prompts, params))

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        use_tqdm: a progress bar on stderr (requests done, output tokens per second). None: shown for
        PROGRESS_MIN_REQUESTS requests or more when stderr is a terminal, so notebooks, tests and logs
        keep clean outputs; True or False decides."""
        seqs, events = self._submit(prompts, params)
        bar = Progress(seqs) if _show_progress(len(seqs), use_tqdm) else None
        try:
            with frozen_heap():  # no full garbage collection walks the model and requests mid-run
                for event in self._follow(seqs, events):
                    if bar is not None:
                        bar.see(event)
        finally:
            if bar is not None:
                bar.close()
        failed = [s for seq in seqs for s in samples_of(seq) if s.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed ({failed[0].error}); the other requests "
                               f"of this call finished, and the engine serves on")
        return [self.output(s) for s in seqs]

    def _follow(self, seqs: list[Sequence], events: deque[StreamEvent]) -> Iterator[StreamEvent]:
        """Drive the engine until these requests are done, yielding their events (and only theirs)."""
        try:
            while True:
                while events:
                    yield events.popleft()
                if all(_done(s) for s in seqs):
                    break
                with self._lock:
                    if not events and not all(_done(s) for s in seqs):
                        self.step()
        finally:  # a consumer that stops early must not leave requests holding cache
            with self._lock:
                for seq in seqs:
                    self.abort(seq)
                    self._listeners.pop(seq.seq_id, None)
                    self._requests.pop(seq.seq_id, None)
                self._last = seqs

    def _submit(self, prompts, params) -> tuple[list[Sequence], deque[StreamEvent]]:
        """Validate every request, then queue them all; their events will go to the returned queue."""
        prompts, params = pair_requests(prompts, params)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all before queuing any
        events: deque[StreamEvent] = deque()
        with self._lock:
            if self.is_paged:
                self.block_manager.reset_sharing_stats()
            for i, seq in enumerate(seqs):
                self._listeners[seq.seq_id] = (events, i)
                self._requests[seq.seq_id] = seq
                for s in samples_of(seq):
                    self.scheduler.add(s)
        return seqs, events

    def _publish(self, seq: Sequence, token: int | None, delta: str) -> None:
        """Hand one event to the stream that submitted seq's request (if a stream did)."""
        listener = self._listeners.get(seq.root.seq_id)
        if listener is not None:
            queue, i = listener
            queue.append(StreamEvent(i, seq.root.request_id, token, delta, seq.is_finished, seq.finish_reason,
                                     sample_index=seq.index))

    def step(self) -> list[tuple[Sequence, int, str]]:
        """One engine step. Returns (sequence, new token, new text) for each sequence that sampled.

        All or nothing for the pool: if anything inside the step raises (a KeyboardInterrupt in a
        notebook, a learner's function, a fault), the engine starts over from a state that is right by
        construction (see `_recover`) before the exception goes on to the caller."""
        with self._lock:
            if self._closed:
                raise RuntimeError(CLOSED_MESSAGE)
            try:
                return self._step()
            except BaseException:
                self._recover()
                raise

    def _step(self) -> list[tuple[Sequence, int, str]]:
        if self._async_scheduling:
            return self._step_overlapped()
        batch = self._schedule()
        if not batch:
            return []
        logits, rows = self.runner.run(batch)
        return self._end_step(batch, self._finish_step(batch, logits, [batch.seqs[r] for r in rows]))

    def _schedule(self) -> ScheduledBatch:
        """The next step's batch (empty when nothing is left to run); observers see it."""
        batch = self.scheduler.schedule()
        while not batch and self.is_paged and self.scheduler.preempt_stalled():
            batch = self.scheduler.schedule()  # stalled beams made room for a waiting sequence
        if not batch:
            if self.scheduler.has_unfinished():  # never spin: say what is stuck
                raise RuntimeError(f"the scheduler could run nothing this step while requests wait "
                                   f"({self.scheduler.__class__.__name__}: {self.stats()}); is the block allocator "
                                   "returning freed blocks?")
            return batch
        self._notify("on_schedule", batch)
        return batch

    def _finish_step(self, batch: ScheduledBatch, logits: torch.Tensor, seqs: list[Sequence]
                     ) -> list[tuple[Sequence, int, str]]:
        """The plain end of a step: sample `seqs` (the sampling rows of `logits`), append, update."""
        ran = without_finished(batch)  # finished already: a wasted row (overlap) or aborted meanwhile
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        if len(live) < len(seqs):
            seqs, logits = [seqs[i] for i in live], logits[live]
        searches = []
        if self.is_paged:
            seqs, logits = fork_samples(self.scheduler, seqs, logits, self._generator)  # n > 1: prompt done
            seqs, logits, searches = take_beam_rows(seqs, logits)  # beams are not sampled: they are ranked
        tokens = self._sample(logits, seqs, _keys(seqs))
        events = []
        for seq, tok in zip(seqs, tokens):
            if tok is None:  # its sampling failed: it alone ends, with the reason
                self._publish(seq, None, "")
                continue
            delta = self._append(seq, tok)
            self._publish(seq, tok, delta)
            events.append((seq, tok, delta))
        self.scheduler.update(ran)  # the sequences that finish now are still in it: their blocks get cached
        for search in searches:
            search.advance(self.scheduler)
        return events

    def _end_step(self, batch: ScheduledBatch, events: list) -> list[tuple[Sequence, int, str]]:
        for seq in batch.seqs:
            if _done(seq.root) and (seq.root.beam_search is None or seq.root.beam_search.done):
                self._requests.pop(seq.root.seq_id, None)
        if self._reset_pending and not self._holds_blocks():
            self.reset_prefix_cache()  # the deferred reset: no request holds blocks any more
        self._notify("on_step", batch, events)
        return events

    # ---- the overlapped step (minikv/engine/overlap.py) -------------------------------------------
    def _step_overlapped(self) -> list[tuple[Sequence, int, str]]:
        """One step's events, with the next step already running on the device (see overlap.py)."""
        t = self._inflight
        if t is None:
            batch = self._schedule()
            if not batch:
                return []
            t = self._launch(batch, self.runner.prepare_step(batch))
        self._inflight = None
        if not self._can_overlap(t):
            events = self._finish_step(t.batch, t.logits, t.seqs)  # waits for the device: t is done after it
            return self._release(t, events)
        # 1. t's samples are one token each, still on the device: placeholders, and t counts as computed
        for seq in t.seqs:
            if not seq.is_finished:
                seq.output_token_ids.append(PLACEHOLDER)
                self._placeholders.append(seq)
        self.scheduler.update(without_finished(t.batch))
        # 2. schedule and prepare t+1 while the device runs t
        nxt_batch, prepared = self.scheduler.schedule(), None
        if nxt_batch.preempted:  # min_free_blocks rules this out; a preempted sequence may hold a placeholder
            raise RuntimeError(f"an overlapped step preempted {[s.request_id for s in nxt_batch.preempted]}, "
                               "which min_free_blocks (minikv/engine/overlap.py) should rule out")
        if nxt_batch:
            row_of = {seq.seq_id: j for j, seq in enumerate(t.seqs) if not seq.is_finished}
            fed = [(i, row_of[seq.seq_id]) for i, seq in enumerate(nxt_batch.seqs) if seq.seq_id in row_of]
            prepared = self.runner.prepare_step(nxt_batch, fed)
        # 3. sample t on the device, start copying its ids to the host, launch t+1 fed by them
        ids = self._sample_on_device(t)
        host = self._copy_to_host(ids, t)
        nxt = self._launch(nxt_batch, prepared, ids) if prepared is not None else None
        self._inflight = nxt
        if nxt is not None:
            self.num_overlapped_steps += 1
            self._notify("on_schedule", nxt_batch)  # after the launch: an observer's abort is deferred as usual
        # 4. only now wait for t's ids; append them (stop rules, text, events) while t+1 runs
        t.wait()
        events = self._finish_overlapped(t, host.tolist(), nxt)
        if nxt is not None and all(seq.is_finished for seq in nxt.batch.seqs):
            self._drain()  # nothing of t+1 is wanted: give its blocks back now, not a step later
        return events

    def _launch(self, batch: ScheduledBatch, prepared, fed_ids: torch.Tensor | None = None) -> InFlight:
        """Queue a prepared step on the device; its sampling keys are taken now (placeholders included)."""
        seqs = [batch.seqs[r] for r in prepared.sample_rows]
        logits = self.runner.forward(batch, prepared, fed_ids)
        return InFlight(batch, logits, seqs, _keys(seqs))

    def _can_overlap(self, t: InFlight) -> bool:
        """Can step t+1 be scheduled before t's tokens are known? (the cases in overlap.py's docstring)"""
        sch, bm = self.scheduler, self.block_manager
        if sch.swapped or bm.offload is not None or self._reset_pending:
            return False
        if any(s.beam_search is not None or s.num_pending_forks for s in t.seqs):
            return False
        if t.seqs and all(s.is_finished for s in t.seqs):  # nothing of t is wanted any more
            return False
        return bm.num_free_blocks >= min_free_blocks(len(sch.running), sch.max_num_batched_tokens, bm.block_size)

    def _sample_on_device(self, t: InFlight) -> torch.Tensor:
        """t's sampled ids as a device tensor. If batched sampling fails, rows are sampled one by one on
        the host (a failing row ends alone, as in the plain step) and their ids sent back; a failed row
        feeds id 0 into t+1, a wasted row."""
        try:
            return sample_on_device(t.logits, [s.params for s in t.seqs], t.keys)
        except Exception:  # noqa: BLE001  _sample finds whose row it is
            tokens = self._sample(t.logits, t.seqs, t.keys)
            t.failed_rows = {i for i, tok in enumerate(tokens) if tok is None}
            return torch.tensor([0 if tok is None else tok for tok in tokens]).to(t.logits.device)

    def _copy_to_host(self, ids: torch.Tensor, t: InFlight) -> torch.Tensor:
        """Start copying t's sampled ids into pinned host memory and record when they are there."""
        if ids.device.type != "cuda":
            return ids
        n = ids.numel()
        if self._token_host.numel() < n:
            self._token_host = torch.empty(max(n, self.scheduler.max_num_seqs), dtype=torch.long, pin_memory=True)
        host = self._token_host[:n]
        host.copy_(ids, non_blocking=True)
        t.done = torch.cuda.Event()
        t.done.record()
        return host

    def _finish_overlapped(self, t: InFlight, tokens: list[int], nxt: InFlight | None
                           ) -> list[tuple[Sequence, int, str]]:
        """t's tokens replace the placeholders: stop rules, text, events. A sequence that finishes here
        but runs in t+1 keeps its blocks until t+1 is done on the device."""
        in_next = {id(seq) for seq in nxt.batch.seqs} if nxt is not None else set()
        events = []
        for i, (seq, tok) in enumerate(zip(t.seqs, tokens)):
            if not seq.output_token_ids or seq.output_token_ids[-1] != PLACEHOLDER:
                continue  # finished before t's ids were wanted (aborted, or a wasted row): nothing to add
            seq.output_token_ids.pop()
            if i in t.failed_rows:  # its sampling failed (finish_reason "error")
                self._publish(seq, None, "")
            elif seq.is_finished:  # aborted during this step (by an observer): abort() did the rest
                continue
            else:
                delta = self._append(seq, tok)
                self._publish(seq, tok, delta)
                events.append((seq, tok, delta))
            if seq.is_finished:
                keep = id(seq) in in_next
                self.scheduler.finish(seq, keep_blocks=keep)
                if keep:
                    nxt.free_after.append(seq)
        self._placeholders = []
        return self._release(t, events)

    def _release(self, t: InFlight, events: list) -> list[tuple[Sequence, int, str]]:
        """t is done on the device: the blocks of the sequences that finished while it ran go back."""
        t.wait()
        for seq in t.free_after:
            self.scheduler.release(seq)
        return self._end_step(t.batch, events)

    def _drain(self) -> list[tuple[Sequence, int, str]]:
        """Finish the step in flight the plain way (nothing is scheduled behind it)."""
        t, self._inflight = self._inflight, None
        if t is None:
            return []
        return self._release(t, self._finish_step(t.batch, t.logits, t.seqs))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], keys: list[int]) -> list[int | None]:
        """Sample the batch at once; if that raises, row by row, so that a failure ends only the
        requests it belongs to (finish_reason "error", the reason in `seq.error`), not the others."""
        if not seqs:
            return []
        try:
            return sample(logits, [s.params for s in seqs], keys)
        except Exception:  # noqa: BLE001  find whose row it is
            pass
        tokens: list[int | None] = []
        for i, seq in enumerate(seqs):
            try:
                tokens.append(sample(logits[i:i + 1], [seq.params], [keys[i]])[0])
            except Exception as e:  # noqa: BLE001  this request's failure, reported on it
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "error"
                seq.error = f"sampling failed: {type(e).__name__}: {e}"
                tokens.append(None)
        return tokens

    def _recover(self) -> None:
        """Start over after a fault inside a step, from a state that is right by construction.

        A step changes many things before it commits (blocks allocated, copies planned, sequences
        preempted, swapped in or forked); rolling each back would need every path to be undoable. Instead,
        the engine forgets its memory bookkeeping and keeps the tokens, which are the truth:

            block tables, ref_counts, prefix cache, swap space   ->  rebuilt empty (as a fresh engine's)
            every unfinished request (queued, running, swapped,  ->  waiting, to be computed again from
            or half-way through a swap or a fork)                    its tokens, as after a preemption
            beam searches in flight                              ->  aborted (their ranking state may be
                                                                     half-advanced)
            an overlapped step in flight, placeholder tokens     ->  the device is drained first, the
                                                                     placeholders dropped (sampled again)
        Tokens already sampled stay: each came from correct logits. Nothing else is lost but time (and the
        prefix cache's content, which a fresh engine would not have either)."""
        self._reset_pending = False
        if self._inflight is not None or self._placeholders:  # drain: the device finishes what it was given
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._inflight = None
            for seq in self._placeholders:  # ids never read back: the sequence samples that token again
                if seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
                    seq.output_token_ids.pop()
            self._placeholders = []
        if self.is_paged:
            for seq in self.scheduler.finishing:  # their blocks belong to the pool about to be rebuilt
                seq.block_table = []
        for root in list(self._requests.values()):
            search = root.beam_search
            if search is not None:
                for beam in search.beams + samples_of(root):
                    beam.status, beam.finish_reason = SequenceStatus.FINISHED, "abort"
                search.beams = []
        seen: dict[int, Sequence] = {s.seq_id: s for s in self.scheduler.all_sequences()}
        for root in self._requests.values():
            seen.update((s.seq_id, s) for s in samples_of(root))
        for s in seen.values():
            if s.beam_search is not None and not s.is_finished:  # a beam forked half-way through an advance
                s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
        live = sorted((s for s in seen.values() if not s.is_finished), key=lambda s: s.seq_id)
        if self.is_paged:
            self.block_manager, self.prefix_cache = self._new_block_manager(self.engine_config)
            self.scheduler.restart(self.block_manager, live)
        else:
            self.scheduler.restart(live)

    def _append(self, seq: Sequence, token: int) -> str:
        """Append a token, apply the stop rules, detokenize (minikv/engine/detokenizer.py). Returns the new
        text: it is never taken back, so a sequence's deltas always join to its final text."""
        import time

        seq.output_token_ids.append(token)
        seq.token_times.append(time.perf_counter())
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        delta = ""
        if self.tokenizer is not None:  # finishing: what was held back goes out; a stop string: cut there
            update = detokenize(self.tokenizer, seq.output_token_ids, seq.text, p.stop, seq.finish_reason is not None)
            seq.text, delta = seq.text + update.delta, update.delta
            if update.stopped:
                seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
        return delta

    def beam_search(self, prompts: Prompt | list[Prompt], beam_width: int = 4, max_tokens: int = 16,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> list[RequestOutput]:
        """Beam search on the paged pool: beams share blocks (fork + copy-on-write), see minikv/engine/beam.py.

        Returns one RequestOutput per prompt; `outputs` holds the best `beam_width` beams, best first, each
        with its `cumulative_logprob` (`token_ids` / `text` at the top level are the best beam's). Beams
        are ranked by cumulative_logprob / num_generated_tokens ** length_penalty. vLLM spells it
        `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens, ignore_eos, length_penalty=...))`
        and returns `BeamSearchOutput(sequences=[...])`, best first. All beams run at once: keep
        max_num_seqs >= beam_width x prompts, or some forks wait their turn and share nothing.
        """
        if not self.is_paged:
            raise ValueError("beam search shares blocks between beams: use kv_backend='paged'")
        if not isinstance(beam_width, int) or not 1 <= beam_width <= self.scheduler.max_num_seqs:
            raise ValueError(f"beam_width must be an integer in [1, max_num_seqs={self.scheduler.max_num_seqs}], "
                             f"got {beam_width!r}; raise max_num_seqs for wider beams")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # beams stop by BeamSearch's rules
        prompts, params = pair_requests(prompts, params)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        searches = [BeamSearch(s, beam_width, max_tokens, self.eos_token_ids, ignore_eos, self.max_model_len)
                    for s in seqs]
        with self._lock:
            self.block_manager.reset_sharing_stats()
            for s in seqs:
                self._requests[s.seq_id] = s
                self.scheduler.add(s)
        self._last = seqs
        try:
            while not all(search.done for search in searches):
                self.step()
        finally:  # an error mid-way must not leave beams holding cache
            with self._lock:
                for search in searches:
                    for beam in search.beams:
                        if not beam.is_finished:
                            beam.status, beam.finish_reason = SequenceStatus.FINISHED, "abort"
                            self.scheduler.abort(beam)
                for s in seqs:
                    self._requests.pop(s.seq_id, None)
        outs = []
        for seq, search in zip(seqs, searches):
            beams = [CompletionOutput(i, h.token_ids, self._decode(h.token_ids), h.finish_reason, h.cumulative_logprob)
                     for i, h in enumerate(search.results(length_penalty))]
            best = search.results(length_penalty)[0]
            outs.append(RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, list(best.token_ids),
                                      beams[0].text, best.finish_reason, RequestMetrics(seq.arrival_time, best.token_times),
                                      outputs=beams))
        return outs

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def abort(self, seq: Sequence) -> None:
        """Stop a request (all its samples) now; whatever cache it holds goes back. A stream of it gets a
        last event with finish_reason "abort"."""
        if not isinstance(seq, Sequence):
            raise ValueError(f"abort takes the Sequence that add_request returned, got {type(seq).__name__} {seq!r}")
        with self._lock:
            seq.num_pending_forks = 0  # samples not forked yet never will be
            inflight = self._inflight
            for s in samples_of(seq):
                if not s.is_finished:
                    s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
                    if inflight is not None and any(s is x for x in inflight.batch.seqs):
                        self.scheduler.finish(s, keep_blocks=True)  # the device may still write its blocks
                        inflight.free_after.append(s)
                    else:
                        self.scheduler.abort(s)
                    held = flush(self.tokenizer, s.output_token_ids, s.text, s.params.stop)
                    s.text += held  # what the detokenizer held back is part of the text after all
                    self._publish(s, None, held)
                elif s in self.scheduler.waiting:  # finished on its first token before it found a seat
                    self.scheduler.abort(s)
            self._requests.pop(seq.seq_id, None)
            if inflight is not None and not self._placeholders and all(s.is_finished for s in inflight.batch.seqs):
                self._drain()  # the step in flight computes nothing wanted: wait for it, free its blocks
                # (not from inside a step, from an observer: the step drains it when it is done)

    # ---- prefix cache (rung 6) ----------------------------------------------------------------
    def _need_prefix_cache(self, what: str) -> PrefixCache:
        if self.prefix_cache is None:
            raise ValueError(f"{what} needs a prefix cache; build the LLM with prefix_caching='hash' or 'radix'")
        return self.prefix_cache

    def reset_prefix_cache(self, defer: bool = False) -> bool:
        """Forget every cached block: call it after changing the weights (cached K/V would be stale).

        Refused with an error while running requests hold cached blocks. With defer=True it waits
        instead: no hits and no new entries from now on, and the cache is cleared as soon as no
        request holds KV blocks. Returns True if the cache was cleared now."""
        self._need_prefix_cache("reset_prefix_cache")
        if defer and self._holds_blocks():
            self.prefix_cache.enabled = False
            self._reset_pending = True
            return False
        self.block_manager.reset_prefix_cache()
        self._reset_pending = False
        if self.offload_store is not None:
            self._reset_offload()
        return True

    def _reset_offload(self) -> None:
        """After a reset: the CPU tier is emptied, and the weights fingerprinted again. Changed weights
        give a new identity, so every stored key changes: the old files are never hit again."""
        cfg, pool = self.engine_config, self.backend.pool
        identity = store_identity(self._weights_fingerprint(fresh=True), self.dtype, pool)
        store = self.offload_store
        if isinstance(store, TieredStore):
            store.clear_memory()
            if store.disk is not None and identity != self._offload_identity:
                store.disk.close()
                self._offload_identity = identity
                store.disk = self._new_disk_tier(cfg, pool)
        self._offload_identity = identity
        self.block_manager.offload.identity = identity
        self.block_manager.offload.reset_stats()

    def _holds_blocks(self) -> bool:
        sch = self.scheduler
        return bool(sch.running or sch.swapped or sch.loading or sch.finishing)

    def pin_prefix(self, prompt: Prompt) -> int:
        """Keep the cached blocks of this prompt's prefix (a system prompt, say) from ever being evicted.
        Computes the prompt first if it is not cached yet. Returns the number of tokens pinned (whole
        blocks: a partial last block is never cached). Undo with `unpin_prefix`. Pinned blocks count
        against every later request: one that could not fit beside them is refused when submitted."""
        cache = self._need_prefix_cache("pin_prefix")
        ids, _, salt = self.encode(prompt)
        full = len(ids) // self.block_size * self.block_size
        if cache.match(ids, salt).num_tokens < full and cache.enabled:
            self.generate({"prompt_token_ids": ids, "cache_salt": salt}, SamplingParams(max_tokens=1))
        return cache.pin(ids, salt)

    def _check_fits_beside_pins(self, ids: list[int], salt: str | None, params: SamplingParams) -> None:
        """Pinned blocks never leave the pool: refuse now a request that could never fit beside them
        (it may share the pinned blocks of its own prefix)."""
        cache = self.prefix_cache
        if cache is None or not cache.pinned:
            return
        pinned = set(cache.pinned)
        usable = self.block_manager.num_blocks - len(pinned) + len(pinned & set(cache.match(ids, salt).blocks))
        need = blocks_needed(min(len(ids) + params.max_tokens, self.max_model_len), self.block_size)
        if need > usable:
            raise ValueError(
                f"this request may need {need} blocks ({len(ids)} prompt + up to {params.max_tokens} output tokens) "
                f"but {len(pinned)} of the pool's {self.block_manager.num_blocks} blocks are pinned by pin_prefix, "
                f"leaving {usable}; unpin_prefix a prefix, raise num_blocks, or lower max_tokens")

    def unpin_prefix(self, prompt: Prompt) -> int:
        """Let the pinned blocks of this prefix be evicted again. Returns the number of tokens unpinned."""
        ids, _, salt = self.encode(prompt)
        return self._need_prefix_cache("unpin_prefix").unpin(ids, salt)

    def stats(self) -> dict:
        """KV usage, preemptions, swap traffic, and per-request latency of the last generate()."""
        cfg = self.engine_config
        out: dict = {"kv_backend": self.kv_backend, "overlapped_steps": self.num_overlapped_steps,
                     "config": {"max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
                                "max_num_batched_tokens": cfg.max_num_batched_tokens, "num_blocks": cfg.num_blocks,
                                "async_scheduling": self.async_scheduling, "chosen": dict(cfg.chosen)}}
        if self.is_paged:
            bm, sch = self.block_manager, self.scheduler
            pool = self.backend.pool
            out.update(
                # the pool: what it stores, the bytes of one token (K and V, all layers, scales included)
                kv_cache_dtype=str(pool.cache_dtype).removeprefix("torch."), bytes_per_token=pool.bytes_per_token,
                pool_bytes=pool.block_bytes * pool.num_blocks,
                num_blocks=bm.num_blocks, block_size=self.block_size, used_blocks=bm.num_used_blocks,
                free_blocks=bm.num_free_blocks, kv_usage=bm.num_used_blocks / bm.num_blocks,
                num_preemptions=sch.num_preemptions, num_recomputes=sch.num_recomputes, num_swaps=sch.num_swaps,
                swapped_out_blocks=sch.swap.blocks_out if sch.swap else 0,
                swapped_in_blocks=sch.swap.blocks_in if sch.swap else 0,
                swap_bytes=(sch.swap.blocks_out + sch.swap.blocks_in) * sch.swap.bytes_per_block if sch.swap else 0,
                # sharing (parallel samples, beams), since the last generate / beam_search:
                # peak_blocks_unshared = peak of the blocks the same block tables would take without sharing
                forks=bm.num_forks, cow_copies=bm.num_cow_copies,
                shared_blocks=sum(1 for r in bm.ref_count if r > 1),
                peak_used_blocks=bm.peak_used_blocks, peak_blocks_unshared=bm.peak_refs,
                sliding_window=self.engine_config.sliding_window, sink_tokens=self.engine_config.sink_tokens,
                window_freed_blocks=bm.num_window_freed,
            )
        out["requests"] = [
            {"request_id": s.request_id, "time_to_first_token": o.time_to_first_token,
             "inter_token_latency": o.inter_token_latency, "num_preemptions": s.num_preemptions,
             "num_cached_tokens": s.num_cached_tokens}
            for s in self._last for o in [self.output(s)]
        ]
        if self.prefix_cache is not None:  # queries and hits count tokens, summed over admissions
            out["prefix_cache"] = self.prefix_cache.stats()
            offload = self.block_manager.offload
            if offload is not None:  # rung 9: where the hits came from, what moved
                pc, off = out["prefix_cache"], offload.stats()
                pc["hits_by_tier"] = {"pool": pc["hits"] - sum(off["hits_by_tier"].values()), **off["hits_by_tier"]}
                pc["offload"] = off
        return out

    def output(self, seq: Sequence) -> RequestOutput:
        """The request `seq` started: its first sample at the top level, every sample in `outputs`."""
        completions = [CompletionOutput(s.index, list(s.output_token_ids), s.text, s.finish_reason)
                       for s in samples_of(seq)]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=seq.text,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(seq.arrival_time, list(seq.token_times)),
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            outputs=completions,
        )
