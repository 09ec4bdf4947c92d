"""The EngineCore: the one place a step happens.

    requests in                               one step                              events out
    add(EngineRequest)  --->  schedule -> run the model -> sample -> apply  --->  [EngineEvent, ...]
    abort(request_id)                                          (stop rules, text, forks,
                                                                beams, cache updates)

Two clients drive it the same way. `LLM` (minikv/engine/llm.py), the offline API, submits the
prompts of one `generate` or `stream` call and follows their events; the server's engine loop
(minikv/serve/engine_loop.py) submits HTTP requests and hands each handler its events. Neither
works anything out again: the tokens, the text deltas (detokenized once, here) and the usage of a
finished request are all in the events. Requests and events are plain data (token ids, sampling
parameters, strings, numbers), so the core can sit behind a queue in a process of its own.

    step():   with the lock (one step at a time, whichever thread drives)
        batch  = scheduler.schedule()                   who runs, how many tokens each, who waits
        logits = runner.run(batch)                      one flattened forward pass
        tokens = sample(logits)                         seeded draws, a failing row ends alone
        apply:  append each token (stop rules, detokenizer), fork n > 1 samples, advance beams,
                scheduler.update (blocks cached, freed), retire finished requests
        events  one EngineEvent per new token; a request's last event carries its usage

On a GPU the step may overlap: step t+1 is scheduled and launched while step t still runs (see
minikv/engine/overlap.py). A step that raises leaves the engine in a state that is right by
construction (see `_recover`). Views, checkers and the server read the engine through `view`
(minikv/engine/view.py), never through the parts below.
"""
from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Callable

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
from minikv.cache.tiers.identity import store_identity, store_key, weights_fingerprint
from minikv.cache.tiers.offload import Offload
from minikv.cache.tiers.tiered import TieredStore
from minikv.engine.batch import ScheduledBatch
from minikv.engine.beam import BeamSearch, take_beam_rows
from minikv.engine.config import EngineConfig, ScratchShape
from minikv.engine.cuda_graph import DecodeGraphs, StepGraphs, step_graph_tokens
from minikv.engine.detokenizer import DecodeState, detokenize, flush, text_in_core
from minikv.engine.fair import VirtualTokenCounter
from minikv.engine.fork import clone, fork_samples, new_seed, sample_seed, samples_of
from minikv.engine.overlap import PLACEHOLDER, InFlight, min_free_blocks, without_finished
from minikv.engine.prompts import check_token_range
from minikv.engine.runner import ModelRunner
from minikv.engine.sampler import DrawPlan, draw_keys, sample, sample_on_device
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.scheduler import Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus
from minikv.engine.simple_scheduler import SimpleScheduler
from minikv.engine.speculative import build_speculator
from minikv.engine.view import EngineView
from minikv.model.loader import LoadedModel

CLOSED_MESSAGE = "the engine is closed (close() or the end of its `with` block); build a new LLM"


@dataclass
class EngineRequest:
    """One request, as a client hands it to the core: token ids (already tokenized and checked by the
    client; the core checks them again at its border), how to sample, and who sent it."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None  # None: the core numbers it
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    prompt: str | None = None  # the text it came from, if any (kept for the output)
    tenant: str | None = None  # who sent it (schedule_policy="vtc" shares the engine fairly between tenants)


@dataclass(frozen=True)
class Usage:
    """What a finished request cost and how it went: on its last event."""

    prompt_tokens: int
    completion_tokens: int  # over every sample
    cached_tokens: int  # prompt tokens the prefix cache served
    num_preemptions: int
    arrival_time: float  # perf_counter seconds
    token_times: tuple[float, ...]  # when each token of its first sample came

    @property
    def time_to_first_token(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None


@dataclass(frozen=True)
class EngineEvent:
    """One thing that happened to one sample of one request in a step.

        a new token     token_id set, text_delta the text it added (may be "": the detokenizer
                        holds back an incomplete character or a possible stop string)
        the sample ends finish_reason set: "stop", "length", "abort" or "error" (then `error` says
                        why; token_id None when it ended without a token)
        the request ends  `usage` set, on the last event of its last sample

    The text deltas of a sample join to its final text: nothing is ever taken back."""

    request_id: str
    index: int  # which of the request's samples (n > 1), 0 otherwise
    token_id: int | None
    text_delta: str = ""
    finish_reason: str | None = None
    error: str | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        """This sample has ended."""
        return self.finish_reason is not None

    @property
    def request_finished(self) -> bool:
        """Every sample of the request has ended (the request's last event)."""
        return self.usage is not None


_EVENT_DEFAULTS = {f.name: f.default for f in fields(EngineEvent)}


def _done(seq: Sequence) -> bool:
    """Every sample of the request seq started has finished (forks still to come count as unfinished)."""
    return not seq.num_pending_forks and all(s.is_finished for s in samples_of(seq))


def _keys(seqs: list[Sequence], rows: list[int] | None = None, seeds=None) -> np.ndarray:
    """The draw keys of these sequences, int64 (greedy ones draw nothing: 0, and are not hashed). rows and
    seeds: the drawing rows and their seeds, where already known (a kept DrawPlan's, `EngineCore._draws`)."""
    keys = np.zeros(len(seqs), dtype=np.int64)
    if rows is None:
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if rows:
        keys[rows] = draw_keys([seqs[i].seed for i in rows] if seeds is None else seeds,
                               [len(seqs[i].output_token_ids) for i in rows])
    return keys


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


def usage_of(root: Sequence) -> Usage:
    samples = samples_of(root)
    return Usage(root.num_prompt_tokens, sum(len(s.output_token_ids) for s in samples), root.num_cached_tokens,
                 sum(s.num_preemptions for s in samples), root.arrival_time, tuple(root.token_times))


def fit_to_model(cfg: EngineConfig, loaded: LoadedModel) -> EngineConfig:
    """The config with its sizes resolved against these weights and this machine (EngineConfig.fit)."""
    c = loaded.config
    return cfg.fit(c.max_position_embeddings,
                   KVPool.bytes_per_block(c.num_layers, cfg.block_size, c.num_kv_heads, c.head_dim, cfg.kv_dtype),
                   c.sliding_window, ScratchShape(c.hidden_size, c.intermediate_size, c.vocab_size, cfg.dtype.itemsize))


class EngineCore:
    """The engine's state and its step. Built from loaded weights and a config (fitted to them here
    unless it is already: see `fit_to_model`)."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, runner_cls: Callable[..., ModelRunner] = ModelRunner,
                 detokenize: bool = True):
        """runner_cls builds the runner (tensor parallelism passes one that also drives the other ranks).
        detokenize=False: events carry token ids and no text, except for requests whose text decides when
        they end (stop strings: see `text_in_core`); a client in another process makes the text from the
        ids (the server: minikv/serve/engine_loop.py). May be switched before the first request."""
        if not cfg.fitted:
            cfg = fit_to_model(cfg, loaded)
        self.loaded, self.engine_config = loaded, cfg
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.device, self.dtype, self.kv_backend = cfg.device, cfg.dtype, cfg.kv_backend
        self.model.fused_ops = cfg.fused_ops  # before any CUDA graph records the model
        c = self.model_config
        self.max_model_len = cfg.max_model_len
        self.is_paged = cfg.is_paged
        self.attention = cfg.attention if cfg.is_paged else None
        self.block_size = cfg.block_size if cfg.is_paged else None
        self.detokenize = detokenize
        self.eos_token_ids = set(c.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self.pool: KVPool | RowPool | None = None  # the KV memory: the cache layer's, lent to the attention
        self.prefix_cache: PrefixCache | None = None
        self.block_manager: BlockManager | None = None
        self.offload_store = None  # rung 9: where blocks the pool evicts go (CPU memory, disk, or yours)
        self._closed = False
        self._observers: list = []
        self._client: weakref.ref | None = None  # what observers are handed: the LLM over the core (or the core)
        self.lock = threading.RLock()  # one step at a time, whichever thread or loop drives the engine
        self._requests: dict[str, Sequence] = {}  # request_id -> the root of every request not done yet
        self._outbox: list[EngineEvent] = []  # events not yet taken (a step's, an abort's)
        self.last_tokens: list[tuple[Sequence, int, str]] = []  # in-process: the sequences behind the last step
        self._reset_pending = False
        self._kv_identity: str | None = None  # kv_identity(), taken on first use and again after a reset
        self._async_scheduling = cfg.async_scheduling
        self._inflight: InFlight | None = None  # the overlapped step launched but not yet read back
        self.intake: Callable[[], None] | None = None  # see `_take_arrivals`
        self._placeholders: list[Sequence] = []  # sequences whose last token is a PLACEHOLDER right now
        self.num_overlapped_steps = 0  # steps launched while the previous one still ran on the device
        self.num_steps = 0  # steps run since start (an empty one too), and the seconds spent inside them:
        self.step_seconds = 0.0  # a server's engine reads its busy share and ms per step from these two
        self.wait_seconds = 0.0  # of those, the seconds an overlapped step waited for the device's sampled ids:
        #   step_seconds - wait_seconds is the host's own work (near step_seconds: the host sets the pace)
        self._token_host = torch.empty(0, dtype=torch.long)  # pinned: where sampled ids land (GPU, overlapped)
        self._drawn = None  # (ids, sequences, DrawPlan, seeds) of the last overlapped step's sampling rows (`_draws`)
        builders = {"naive": self._build_naive, "contiguous": self._build_contiguous, "paged": self._build_paged}
        builders[cfg.kv_backend](cfg)
        graphs = small = None
        if cfg.cuda_graphs:
            graphs = DecodeGraphs(self.model, self.backend, self.device, self.block_size, cfg.max_num_seqs,
                                  self.max_model_len, c.vocab_size)
            largest = step_graph_tokens(cfg.cuda_graph_max_tokens, cfg.max_num_batched_tokens, self.max_model_len)
            if largest >= 16:  # the smallest bucket; no graph for a step larger than any step can be
                small = StepGraphs(self.model, self.backend, self.device, self.block_size, cfg.max_num_seqs,
                                   self.max_model_len, graphs.logits, largest, graphs.memory_pool)
            with torch.inference_mode():
                graphs.capture_all()
                if small is not None:
                    small.capture_all()
        self.runner = runner_cls(self.model, self.backend, self.device, self.block_size, graphs,
                                 step_graphs=small,
                                 **_given(slot_mapping=cfg.slot_mapping), pool=self.pool if self.is_paged else None)
        self.speculator = build_speculator(cfg, loaded, cfg.num_blocks) if cfg.is_paged else None  # rung 11
        if self.speculator is not None:
            self.scheduler.num_drafts = self.speculator.num_drafts

    # ---- one builder per rung -------------------------------------------------------------------
    def _build_naive(self, cfg: EngineConfig) -> None:
        """Rung 1: no cache; every step feeds the whole sequence again."""
        if cfg.causal_attention is not None:
            self.backend = CausalAttentionSeam(cfg.causal_attention)
        else:
            self.backend = NaiveBackend(self.model_config.sliding_window)
        self.scheduler = SimpleScheduler(None, cfg.max_num_seqs)

    def _build_contiguous(self, cfg: EngineConfig) -> None:
        """Rung 2: one preallocated row of max_model_len positions per running request."""
        c = self.model_config
        rows = RowPool(c.num_layers, cfg.max_num_seqs, self.max_model_len, c.num_kv_heads, c.head_dim, self.dtype,
                       self.device)
        self.pool = rows
        self.backend = ContiguousBackend(rows, c.sliding_window)
        if cfg.decode_step is not None:
            self.backend = DecodeStepSeam(self.backend, cfg.decode_step)
        self.scheduler = SimpleScheduler(rows, cfg.max_num_seqs)

    def _build_paged(self, cfg: EngineConfig) -> None:
        """Rungs 4-7: a block pool, block tables, a continuous-batching scheduler, optionally a prefix cache."""
        c = self.model_config
        if cfg.attention == "triton":
            from minikv.attention.triton_backend import TritonPagedBackend as backend_cls
            extra = _given(decode_inner_loop=cfg.decode_inner_loop)
        else:
            backend_cls, extra = PagedBackend, {}
        pool = KVPool(c.num_layers, cfg.num_blocks, cfg.block_size, c.num_kv_heads, c.head_dim, self.dtype,
                      self.device, cfg.kv_layout, cfg.kv_dtype, cfg.kv_quantizer)
        self.pool = pool
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
            cache = make_prefix_cache(design, cfg.block_size, cfg.eviction, radix_insert=cfg.radix_insert,
                                      radix_evict_leaf=cfg.radix_evict_leaf, free_block_queue=cfg.free_block_queue)
            bm.attach_prefix_cache(cache)
            if self.offload_store is not None:
                bm.attach_offload(Offload(self.pool, cache, self.offload_store, self._offload_identity))
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

    # ---- life -----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Abort every request not finished yet (each gets its last event), write the offload tiers'
        queued blocks through and stop their writer, then give back the memory the engine allocated (the
        pool, the swap space, the CPU tier, the CUDA graphs and staging buffers; on a GPU to the driver
        too). Afterwards `step()` and `add()` raise CLOSED_MESSAGE. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True  # first: a request submitted from now on is refused
            for root in list(self._requests.values()):
                self.abort(root)
            self._drain()  # an overlapped step still on the device: wait for it, give its blocks back
            self._drawn = None
            offload = self.block_manager.offload if self.block_manager is not None else None
            if offload is not None:
                offload.close()  # cached blocks queued for write-through go to the store before it closes
            if isinstance(self.offload_store, TieredStore):
                self.offload_store.close()
            self._release_memory()

    def _release_memory(self) -> None:
        """Every tensor the engine allocated goes (the objects stay, empty, so stats() still answers)."""
        if self.pool is not None:  # KVPool (paged), RowPool (contiguous), none (naive)
            self.pool.close()
        swap = getattr(self.scheduler, "swap", None)
        if swap is not None:
            swap.close()
        self.runner.close()
        self._token_host = torch.empty(0, dtype=torch.long)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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
        if on and self.speculator is not None:
            raise ValueError("speculative decoding needs each step's accepted tokens before the next is scheduled; "
                             "build an engine without speculative to overlap steps")
        with self.lock:
            self._drain()
            self._async_scheduling = on

    @property
    def view(self) -> EngineView:
        """A read-only view of the engine's state (minikv/engine/view.py): what views, checkers and the
        server read."""
        return EngineView(self)

    # ---- observers ------------------------------------------------------------------------------
    def add_observer(self, observer) -> Callable[[], None]:
        """Watch every step: `observer.on_schedule(engine, batch)` once the scheduler picked the batch
        (before the model runs), `observer.on_step(engine, batch, events)` once the step is done (events:
        (sequence, token, text delta) of each sequence that sampled), and `observer.on_event(engine,
        step, request_id, event)` for each scheduler event of a paged engine (arrive, load, admit,
        preempt, swap_out, swap_in, fork, finish, abort); any may be missing. `engine` is the client
        the core was built by (the LLM). Returns `remove()`."""
        if not any(hasattr(observer, hook) for hook in ("on_schedule", "on_step", "on_event")):
            raise ValueError("an observer needs an on_schedule(llm, batch), on_step(llm, batch, events) or "
                             "on_event(llm, step, request_id, event) method")
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def observed_as(self, client) -> None:
        """Observers are handed `client` (held weakly: the client owns the core, not the other way)."""
        self._client = weakref.ref(client)

    def _on_event(self, step: int, request_id: str, event: str) -> None:
        self._notify("on_event", step, request_id, event)

    def _notify(self, hook: str, *args) -> None:
        if not self._observers:
            return
        owner = (self._client() if self._client is not None else None) or self
        for obs in list(self._observers):
            fn = getattr(obs, hook, None)
            if fn is not None:
                fn(owner, *args)

    # ---- requests in ----------------------------------------------------------------------------
    def new_sequence(self, request: EngineRequest) -> Sequence:
        """Check a request against the engine (its ids, length, sampling) and make its sequence (and,
        without a paged pool, its n - 1 sibling samples); nothing is queued yet."""
        if self._closed:
            raise RuntimeError(CLOSED_MESSAGE)
        if not isinstance(request, EngineRequest):
            raise ValueError(f"the core takes an EngineRequest, got {type(request).__name__} {request!r}")
        params, ids = request.params, request.prompt_token_ids
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (or a list of them, one per prompt), "
                             f"got {type(params).__name__} {params!r}")
        params = copy.copy(params)  # the engine's own: a caller's later change to a shared object changes no
        #   running request (and the overlapped step keeps what it worked out from them, `_draws`)
        id_bytes = check_token_range(ids, self.model_config.vocab_size)
        self.check_length(len(ids))
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} can never match: model {self.model_config.model_type!r} "
                             "has no tokenizer, so no text is produced; stop on token ids with EOS, or load a model "
                             "with one")
        if request.tenant is not None and not isinstance(request.tenant, str):
            raise ValueError(f"tenant must be a string or None, got {type(request.tenant).__name__} {request.tenant!r}")
        if self.is_paged:
            self._check_fits_beside_pins(ids, request.cache_salt, params)
        seq = Sequence(ids, params, request_id=request.request_id, cache_salt=request.cache_salt, prompt=request.prompt)
        seq.prompt_bytes = id_bytes  # the prefix cache's hash chain reads these instead of converting the ids again
        seq.tenant = request.tenant
        seq.seed = params.seed if params.seed is not None else new_seed(self._generator)
        if params.n > 1:
            if self.is_paged:  # paged: prefill once, then fork (minikv/engine/fork.py)
                if params.n > self.scheduler.max_num_seqs:
                    raise ValueError(f"n={params.n} parallel samples run at once but max_num_seqs is "
                                     f"{self.scheduler.max_num_seqs}; raise max_num_seqs or lower n")
                seq.num_pending_forks = params.n - 1
            else:  # no blocks to share: n independent sequences, each prefilled on its own
                for i in range(1, params.n):
                    sample_ = clone(seq, i)
                    sample_.seed = sample_seed(seq, i, self._generator)
                    seq.forks.append(sample_)
        return seq

    def check_length(self, num_tokens: int) -> None:
        """A prompt of num_tokens tokens can run here, or a ValueError that says why not and what to do."""
        if num_tokens <= self.max_model_len:
            return
        if self.block_size is not None and self.max_model_len == self.block_manager.num_blocks * self.block_size:
            raise ValueError(
                f"prompt has {num_tokens:,} tokens but the KV pool holds only {self.max_model_len:,} "
                f"({self.block_manager.num_blocks} blocks x {self.block_size}); it can never fit: raise "
                "num_blocks or kv_cache_memory, or shorten the prompt")
        raise ValueError(f"prompt has {num_tokens:,} tokens but max_model_len is {self.max_model_len:,}; "
                         "raise max_model_len or shorten the prompt")

    def enqueue(self, seqs: list[Sequence]) -> None:
        """Queue sequences made by `new_sequence` (all of them, or none if one id is taken)."""
        with self.lock:
            if self._closed:
                raise RuntimeError(CLOSED_MESSAGE)
            ids = [s.request_id for s in seqs]
            taken = next((i for i in ids if i in self._requests), None)
            if taken is None and len(set(ids)) < len(ids):
                taken = next(i for i in ids if ids.count(i) > 1)
            if taken is not None:
                raise ValueError(f"request id {taken!r} is already running; give each live request its own id")
            for seq in seqs:
                self._requests[seq.request_id] = seq
                for s in samples_of(seq):
                    self.scheduler.add(s)

    def add(self, request: EngineRequest) -> Sequence:
        """Check and queue one request (a bad one raises and leaves the engine untouched). Returns its
        sequence (in-process; a client across a process boundary keeps the request id)."""
        seq = self.new_sequence(request)
        self.enqueue([seq])
        return seq

    def has_unfinished(self) -> bool:
        """Requests still to run, or an overlapped step still on the device (its blocks still held)."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def num_requests(self) -> int:
        """Requests added and not yet finished (each counts once, whatever its n)."""
        return len(self._requests)

    def abort(self, request: str | Sequence) -> None:
        """Stop a request (all its samples) now, by id (or, in-process, the sequence `add` returned);
        whatever cache it holds goes back, and each unfinished sample gets a last event with
        finish_reason "abort". A request already finished is left as it is."""
        with self.lock:
            self._drawn = None  # the kept draw plan lets go of its sequences (`_draws`)
            if isinstance(request, Sequence):
                seq = request.root
            elif isinstance(request, str):
                seq = self._requests.get(request)
                if seq is None:
                    return
            else:
                raise ValueError(f"abort takes a request id or the Sequence that add returned, "
                                 f"got {type(request).__name__} {request!r}")
            seq.num_pending_forks = 0  # samples not forked yet never will be
            inflight = self._inflight
            for s in samples_of(seq):
                if not s.is_finished:
                    if self.speculator is not None:  # aborted inside a step: its draft tokens are not output
                        self.speculator.drop(s)
                    s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
                    if inflight is not None and any(s is x for x in inflight.batch.seqs):
                        self.scheduler.finish(s, keep_blocks=True)  # the device may still write its blocks
                        inflight.free_after.append(s)
                    else:
                        self.scheduler.abort(s)
                    held = flush(self._tokenizer_for(s), s.output_token_ids, s.text, s.params.stop)
                    s.text += held  # what the detokenizer held back is part of the text after all
                    self._publish(s, None, held)
                elif s in self.scheduler.waiting:  # finished on its first token before it found a seat
                    self.scheduler.abort(s)
            if self._requests.get(seq.request_id) is seq:
                self._retire(seq)
            if inflight is not None and not self._placeholders and all(s.is_finished for s in inflight.batch.seqs):
                self._drain()  # the step in flight computes nothing wanted: wait for it, free its blocks
                # (not from inside a step, from an observer: the step drains it when it is done)

    # ---- events out -----------------------------------------------------------------------------
    def _publish(self, seq: Sequence, token: int | None, delta: str) -> None:
        """One event of seq's request, for whichever client takes the events. One per token, so it is built
        without the frozen dataclass's __init__ (an object.__setattr__ per field, twice the cost): the
        same EngineEvent, its fields written into its __dict__ (those not named here keep their defaults;
        item by item: a third less than update's keyword arguments)."""
        event = object.__new__(EngineEvent)
        d = event.__dict__
        d.update(_EVENT_DEFAULTS)
        d["request_id"], d["index"], d["token_id"], d["text_delta"] = seq.root.request_id, seq.index, token, delta
        d["finish_reason"], d["error"] = seq.finish_reason if seq.is_finished else None, seq.error
        self._outbox.append(event)

    def _retire(self, root: Sequence) -> None:
        """Every sample of root's request has ended: it leaves the engine's books, and its last event
        carries its usage."""
        del self._requests[root.request_id]
        usage = usage_of(root)
        for i in range(len(self._outbox) - 1, -1, -1):
            if self._outbox[i].request_id == root.request_id:
                self._outbox[i] = replace(self._outbox[i], usage=usage)
                return
        self._outbox.append(EngineEvent(root.request_id, root.index, None, "", root.finish_reason or "abort",
                                        root.error, usage))

    def take_events(self) -> list[EngineEvent]:
        """The events not yet taken, in order (a step's are returned by `step`; an abort's wait here)."""
        with self.lock:
            out, self._outbox = self._outbox, []
            return out

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[EngineEvent]:
        """One engine step; returns its events (and any left from aborts since the last step).

        All or nothing for the pool: if anything inside the step raises (a KeyboardInterrupt in a
        notebook, a learner's function, a fault), the engine starts over from a state that is right by
        construction (see `_recover`) before the exception goes on to the caller; the events of tokens
        already made wait for the next `take_events`."""
        with self.lock:
            self.run_step()
            return self.take_events()

    def run_step(self) -> list[tuple[Sequence, int, str]]:
        """One step, its events left in the outbox. Returns (sequence, token, text delta) of each
        sequence that sampled (in-process; what observers see)."""
        with self.lock:
            if self._closed:
                raise RuntimeError(CLOSED_MESSAGE)
            start = time.perf_counter()
            try:
                self.last_tokens = self._step()
            except BaseException:
                self._recover()
                raise
            finally:
                self.num_steps += 1
                self.step_seconds += time.perf_counter() - start
            return self.last_tokens

    def _step(self) -> list[tuple[Sequence, int, str]]:
        if self.speculator is not None:  # drafts verified in this step (minikv/engine/speculative.py)
            return self.speculator.step(self)
        if self._async_scheduling:
            return self._step_overlapped()
        batch = self._schedule()
        if not batch:
            return []
        logits, rows = self.runner.run(batch)
        return self._end_step(batch, self._finish_step(batch, logits, [batch.seqs[r] for r in rows]))

    def _take_arrivals(self) -> None:
        """Called right before the scheduler forms a batch. A driver that takes requests from elsewhere (the
        engine process's command pipe, minikv/serve/core_process.py) sets `intake` to add what has arrived
        since it last looked: a request that came in while the last step was being launched then runs in
        the very next step. Without it, an overlapped step's successor is formed before control returns to
        the driver, so a burst's requests waited two steps, not one (the first two steps of a burst were a
        prompt or two each). `intake` may only add requests (`add`), never abort or step."""
        if self.intake is not None:
            self.intake()

    def _schedule(self) -> ScheduledBatch:
        """The next step's batch (empty when nothing is left to run); observers see it."""
        self._take_arrivals()
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
        """The plain end of a step: sample `seqs` (the sampling rows of `logits`), apply, update."""
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
            delta = self.append_token(seq, tok)
            self._publish(seq, tok, delta)
            events.append((seq, tok, delta))
        self.scheduler.update(ran)  # the sequences that finish now are still in it: their blocks get cached
        for search in searches:
            search.advance(self.scheduler)
        return events

    def _end_step(self, batch: ScheduledBatch, events: list) -> list[tuple[Sequence, int, str]]:
        for seq in batch.seqs:
            root = seq.root
            if root is seq and not seq.is_finished:  # a request's first sample, still running: not done
                continue
            if seq.is_finished:
                self._drawn = None  # the kept draw plan lets go of its sequences (`_draws`)
            if (_done(root) and (root.beam_search is None or root.beam_search.done)
                    and self._requests.get(root.request_id) is root):
                self._retire(root)
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
        row_of, placeholders = {}, self._placeholders  # row_of: seq_id -> its row of t's samples (below)
        for j, seq in enumerate(t.seqs):
            if not seq.is_finished:
                seq.output_token_ids.append(PLACEHOLDER)
                placeholders.append(seq)
                row_of[seq.seq_id] = j
        self.scheduler.update(without_finished(t.batch))
        # 2. schedule and prepare t+1 while the device runs t
        self._take_arrivals()
        nxt_batch, prepared = self.scheduler.schedule(), None
        if nxt_batch.preempted:  # min_free_blocks rules this out; a preempted sequence may hold a placeholder
            raise RuntimeError(f"an overlapped step preempted {[s.request_id for s in nxt_batch.preempted]}, "
                               "which min_free_blocks (minikv/engine/overlap.py) should rule out")
        if nxt_batch:  # a row of t+1 whose sequence sampled in t is fed t's id (a finished one is not scheduled)
            fed = [(i, j) for i, seq in enumerate(nxt_batch.seqs) if (j := row_of.get(seq.seq_id)) is not None]
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
        waited = time.perf_counter()
        t.wait()
        tokens = host.tolist()
        self.wait_seconds += time.perf_counter() - waited
        events = self._finish_overlapped(t, tokens, nxt)
        if nxt is not None and all(seq.is_finished for seq in nxt.batch.seqs):
            self._drain()  # nothing of t+1 is wanted: give its blocks back now, not a step later
        return events

    def _launch(self, batch: ScheduledBatch, prepared, fed_ids: torch.Tensor | None = None) -> InFlight:
        """Queue a prepared step on the device; its sampling keys are taken now (placeholders included)."""
        seqs = [batch.seqs[r] for r in prepared.sample_rows]
        logits = self.runner.forward(batch, prepared, fed_ids)
        plan, keys = self._draws(seqs)
        return InFlight(batch, logits, seqs, keys, plan=plan)

    def _draws(self, seqs: list[Sequence]) -> tuple[DrawPlan, np.ndarray]:
        """The sampling rows' DrawPlan and this step's draw keys (`_keys`'s). The plan is kept while the rows
        are the same sequences in the same order, as they are from one decode step to the next: a sequence's
        params and seed never change once it is made (its params are the engine's copy, `new_sequence`). The
        sequences are held with it, so no other object can take one of their ids meanwhile; it lets go of them
        as soon as one finishes or is aborted, so no finished sequence outlives its step here (a frozen heap,
        gc_pause.py, would otherwise keep it for good)."""
        ids = list(map(id, seqs))
        if self._drawn is None or self._drawn[0] != ids:
            plan = DrawPlan([s.params for s in seqs])
            self._drawn = (ids, seqs, plan, np.array([seqs[i].seed for i in plan.sampled_rows], dtype=np.uint64))
        _, _, plan, seeds = self._drawn
        return plan, _keys(seqs, plan.sampled_rows, seeds)

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
            return sample_on_device(t.logits, [s.params for s in t.seqs], t.keys, t.plan)
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
        in_next = None  # ids of the sequences of t+1, built when a sequence first finishes here
        events, failed, now = [], t.failed_rows, time.perf_counter()  # t's tokens all came at this moment
        append_token, publish = self.append_token, self._publish
        for i, (seq, tok) in enumerate(zip(t.seqs, tokens)):
            out = seq.output_token_ids
            if not out or out[-1] != PLACEHOLDER:
                continue  # finished before t's ids were wanted (aborted, or a wasted row): nothing to add
            out.pop()
            if failed and i in failed:  # its sampling failed (finish_reason "error")
                publish(seq, None, "")
            elif seq.is_finished:  # aborted during this step (by an observer): abort() did the rest
                continue
            else:
                delta = append_token(seq, tok, now)
                publish(seq, tok, delta)
                events.append((seq, tok, delta))
            if seq.is_finished:
                if in_next is None:
                    in_next = {id(s) for s in nxt.batch.seqs} if nxt is not None else set()
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
        t, self._inflight, self._drawn = self._inflight, None, None
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
        self._reset_pending, self._drawn = False, None
        if self.speculator is not None:  # drafts still in the tokens leave them
            self.speculator.strip_all()
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

    def append_token(self, seq: Sequence, token: int, now: float | None = None) -> str:
        """Append a token, apply the stop rules, detokenize (minikv/engine/detokenizer.py). Returns the new
        text: it is never taken back, so a sequence's deltas always join to its final text. (Static
        batching, minikv/engine/static_batching.py, finishes its rows with it too.) now: the moment the
        token became known (a step's tokens all arrive at once: one clock reading for all of them)."""
        out = seq.output_token_ids
        out.append(token)
        seq.token_times.append(time.perf_counter() if now is None else now)
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(out) >= p.max_tokens or len(seq.prompt_token_ids) + len(out) >= self.max_model_len:
            seq.finish_reason = "length"
        delta = ""
        if self.tokenizer is not None and (self.detokenize or text_in_core(p, seq.beam_search is not None)):
            # (`_tokenizer_for`, inline) finishing: what was held back goes out; a stop string: cut there
            if seq.decode_state is None and seq.beam_search is None:  # beams rewrite outputs: decode them whole
                seq.decode_state = DecodeState()
            update = detokenize(self.tokenizer, seq.output_token_ids, seq.text, p.stop, seq.finish_reason is not None,
                                seq.decode_state)
            seq.text, delta = seq.text + update.delta, update.delta
            if update.stopped:
                seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
        return delta

    def _tokenizer_for(self, seq: Sequence):
        """The tokenizer that makes seq's text here, or None (no tokenizer, or its client makes the text)."""
        if self.detokenize or text_in_core(seq.params, seq.beam_search is not None):
            return self.tokenizer
        return None

    # ---- beam search (minikv/engine/beam.py) -----------------------------------------------------
    def run_beam_search(self, seqs: list[Sequence], searches: list[BeamSearch]) -> None:
        """Queue the roots of these searches and step until every search is done; beams left running
        by an error are aborted, so no beam keeps cache."""
        with self.lock:
            self.block_manager.reset_sharing_stats()
            self.enqueue(seqs)
        try:
            while not all(search.done for search in searches):
                self.run_step()
        finally:  # an error mid-way must not leave beams holding cache
            with self.lock:
                for search in searches:
                    for beam in search.beams:
                        if not beam.is_finished:
                            beam.status, beam.finish_reason = SequenceStatus.FINISHED, "abort"
                            self.scheduler.abort(beam)
                for s in seqs:
                    if self._requests.get(s.request_id) is s:
                        self._retire(s)

    def reset_sharing_stats(self) -> None:
        """Forks, copies and peaks counted from now on (stats() reports them per generate call)."""
        if self.block_manager is not None:
            self.block_manager.reset_sharing_stats()

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
        with self.lock:
            self._need_prefix_cache("reset_prefix_cache")
            if defer and self._holds_blocks():
                self.prefix_cache.enabled = False
                self._reset_pending = True
                return False
            self.block_manager.reset_prefix_cache()
            self._reset_pending = False
            self._kv_identity = None  # the weights may have changed: taken again on next use
            if self.offload_store is not None:
                self._reset_offload()
            return True

    def _reset_offload(self) -> None:
        """After a reset: the CPU tier is emptied, and the weights fingerprinted again. Changed weights
        give a new identity, so every stored key changes: the old files are never hit again."""
        cfg, pool = self.engine_config, self.pool
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

    def pin_prefix(self, ids: list[int], salt: str | None = None) -> int:
        """Keep the cached blocks of this prefix from ever being evicted (computing it first if it is
        not cached yet; other requests' events of those steps wait for the next `take_events`).
        Returns the number of tokens pinned (whole blocks)."""
        cache = self._need_prefix_cache("pin_prefix")
        full = len(ids) // self.block_size * self.block_size
        with self.lock:
            if cache.match(ids, salt).num_tokens < full and cache.enabled:
                seq = self.add(EngineRequest(ids, SamplingParams(max_tokens=1), cache_salt=salt))
                while not _done(seq):
                    self.run_step()
            return cache.pin(ids, salt)

    def unpin_prefix(self, ids: list[int], salt: str | None = None) -> int:
        """Let the pinned blocks of this prefix be evicted again. Returns the number of tokens unpinned."""
        with self.lock:
            return self._need_prefix_cache("unpin_prefix").unpin(ids, salt)

    # ---- a prompt's KV blocks sent to another engine (rung 13, minikv/serve/disagg.py) ------------
    def kv_identity(self) -> str:
        """What besides the tokens decides a block's bytes here (the weights, the dtype, the pool's format):
        blocks sent between engines are keyed by it (identity.store_key), so a block only ever lands in an
        engine that would have computed the same bytes.

        Taken once and kept, as the offload tiers' identity is: stamping the weights reads a sample of
        every tensor, and a disaggregated pair asks for the identity on every transfer. Weights changed
        in place need `reset_prefix_cache()` (cached K/V would be stale), and that takes it again."""
        if self._kv_identity is None:
            self._kv_identity = store_identity(self._weights_fingerprint(), self.dtype, self.pool)
        return self._kv_identity

    def held_prefix_blocks(self, ids: list[int], salt: str | None = None) -> int:
        """How many full blocks of this prompt the pool's prefix cache holds (no side effects)."""
        return len(self._need_prefix_cache("held_prefix_blocks").match(ids, salt).blocks)

    def export_prefix(self, ids: list[int], salt: str | None = None, on_device: bool = False
                      ) -> tuple[list[bytes], tuple]:
        """The cached full blocks of this prompt, to send to another engine: their store keys (the hash
        chain's key of each block, salt included, under `kv_identity`) and their tensors, each
        [num_layers, len(keys), block_size, ...] as `KVPool.read_blocks` gives them: a copy on the CPU, or
        with `on_device` a copy on the pool's device (NCCL sends from there: no round trip through the host)."""
        cache = self._need_prefix_cache("export_prefix")
        if not hasattr(cache, "key_of"):
            raise ValueError("export_prefix keys blocks by the hash chain; build the LLM with prefix_caching='hash'")
        with self.lock:
            blocks = cache.match(ids, salt).blocks
            if not blocks:
                return [], ()
            identity = self.kv_identity()
            keys = [store_key(identity, cache.key_of(b)) for b in blocks]
            planes = self.pool.read_blocks(blocks)  # gathered: a copy, not views of the pool
            if not on_device:
                return keys, tuple(t.to("cpu") for t in planes)
            if self.device.type == "cuda":  # done before another thread (its own stream) reads them
                torch.cuda.current_stream(self.device).synchronize()
            return keys, planes

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

    # ---- what it reports ------------------------------------------------------------------------
    def stats(self) -> dict:
        """KV usage, preemptions, swap traffic, sharing, the prefix cache and its tiers."""
        cfg = self.engine_config
        out: dict = {"kv_backend": self.kv_backend, "overlapped_steps": self.num_overlapped_steps,
                     "config": {"max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
                                "max_num_batched_tokens": cfg.max_num_batched_tokens, "num_blocks": cfg.num_blocks,
                                "async_scheduling": self.async_scheduling, "chosen": dict(cfg.chosen)}}
        if self.is_paged:
            bm, sch, pool = self.block_manager, self.scheduler, self.pool
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
                sliding_window=cfg.sliding_window, sink_tokens=cfg.sink_tokens,
                window_freed_blocks=bm.num_window_freed,
            )
        if self.speculator is not None:  # rung 11: drafted, accepted, acceptance rate
            out["speculative"] = self.speculator.stats()
        if self.prefix_cache is not None:  # queries and hits count tokens, summed over admissions
            out["prefix_cache"] = self.prefix_cache.stats()
            offload = self.block_manager.offload
            if offload is not None:  # rung 9: where the hits came from, what moved
                pc, off = out["prefix_cache"], offload.stats()
                pc["hits_by_tier"] = {"pool": pc["hits"] - sum(off["hits_by_tier"].values()), **off["hits_by_tier"]}
                pc["offload"] = off
        return out
