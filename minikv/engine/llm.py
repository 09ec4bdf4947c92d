"""The offline face of the engine: `LLM(model, ...)`, `generate`, `stream`, `chat_prompt`, `stats`.

    llm = LLM("smollm2-135m", kv_backend="contiguous")
    out = llm.generate(["The KV cache is"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].time_to_first_token)

`LLM` checks the options (minikv/engine/config.py), loads the weights, and builds an `EngineCore`
(minikv/engine/core.py), the one place a step happens. It is a client of the core's events, as the
server is: `generate` turns prompts into requests, steps the core until they are done, and hands
each call exactly its own events.
"""
from __future__ import annotations

import sys
from collections import deque
from typing import Callable, Iterator

import torch

from minikv.engine.beam import BeamSearch
from minikv.engine.config import EngineConfig
from minikv.engine.core import CLOSED_MESSAGE, EngineCore, EngineEvent, EngineRequest, _done, fit_to_model
from minikv.engine.fork import samples_of
from minikv.engine.gc_pause import frozen_heap
from minikv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent
from minikv.engine.prompts import is_single_prompt, parse_prompt
from minikv.engine.runner import ModelRunner
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence
from minikv.model.loader import LoadedModel, load_model

Prompt = str | list[int] | dict
__all__ = ["CLOSED_MESSAGE", "LLM", "Prompt", "pair_requests"]


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
        default on with Triton attention on a GPU, see minikv/engine/cuda_graph.py), cuda_graph_max_tokens
        (with cuda_graphs, steps of up to this many new tokens replay from graphs too, bucketed 16, 32, ...,
        1,024, 2,048, 3,072, ...; default 8,192, 0 for decode steps only), kv_cache_dtype (what
        the pool stores: "auto" the model's dtype, "int8" or "fp8" e4m3 with a float32 scale per token
        and KV head, and for int8 a zero point, about half the bytes of a 16-bit pool; see
        minikv/cache/blocks/quant.py),
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
        also written to files there as they are cached, and a later engine of the same model finds them. A
        lookup that misses the pool copies stored blocks back. Call `close()`
        (or use `with LLM(...) as llm:`) to finish the disk writes. See minikv/cache/tiers/.

        Named seams, where your own code runs inside the engine (each exercise plugs into one):
            causal_attention=fn   rung 1  attention of one whole sequence (kv_backend="naive")
            decode_step=fn        rung 2  one decode step on a contiguous cache row (kv_backend="contiguous")
            block_allocator=cls   rung 4  hands out and takes back block ids
            slot_mapping=fn       rung 4  physical slot of each new token
            schedule_step=fn      rung 5  which sequences run this step, and how many tokens each
            copy_on_write=fn      rung 6  private copies of the shared blocks a step writes into
            radix_insert=fn       rung 6  makes the radix tree spell a request's blocks (prefix_caching="radix")
            radix_evict_leaf=fn   rung 6  trims unused blocks off a radix leaf's tail (prefix_caching="radix")
            free_block_queue=cls  rung 6  the hash chain's unused blocks, LRU first (prefix_caching="hash")
            decode_inner_loop=fn  rung 7  the Triton decode kernel's online-softmax step
            window_free_rule=fn   rung 8  which blocks a sliding window gives back (needs sliding_window)
            kv_quantizer=fn       rung 8  quantizes K/V rows (with their scales) as the pool stores them
            kv_offload_store=obj  rung 9  keeps the blocks the pool evicts (put, get, in)
            pick_next=fn          rung 10 which waiting request the fair scheduler admits next
            spec_rollback=fn      rung 11 gives back the blocks of rejected drafts (needs speculative)
        Views and checkers watch the engine through `add_observer`.

        Speculative decoding (rung 11, paged): speculative "ngram" (drafts from the request's own tokens)
        or "draft" (draft_model proposes: a smaller model sharing the tokenizer, or "self:N", the target's
        first N layers and LM head), num_speculative_tokens (k, default 4) verified in one step,
        speculative_disable_by_batch_size (no drafts while more requests run; on a GPU 4 by default, the
        batch where drafts stopped paying on an H100); see
        minikv/engine/speculative.py.
            shard_heads=fn        rung 12 which attention heads each tensor-parallel rank holds
        Views and checkers watch the engine through `add_observer`.

        Tensor parallelism (rung 12, paged): tensor_parallel_size=N runs the model on N processes (one per
        GPU, rank 0 this one, with the scheduler), each holding 1/N of every layer and its own K/V heads,
        over torch.distributed (NCCL on GPUs, gloo on CPUs); tensor_parallel_timeout (seconds) bounds how
        long a step waits for a silent rank before the engine fails. See minikv/engine/parallel.py.

        Sliding window (rung 8, paged): sliding_window=W, sink_tokens=S: each query sees the first S
        and the last W positions (StreamingLLM), and blocks outside every later window go back to
        the pool while the request runs (minikv/cache/blocks/window.py). None: the model's own window, if
        its config has one (Mistral); a window on a model trained without one changes its outputs.
        """
        cfg = EngineConfig.from_options(model=model, device=device, dtype=dtype, kv_backend=kv_backend,
                                        max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, **options)
        self._options = dict(device=device, dtype=dtype, kv_backend=kv_backend, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, seed=seed, **options)
        device, dtype = cfg.device, cfg.dtype
        if isinstance(model, LoadedModel):  # the weights of another engine (see derive)
            if model.released:
                raise ValueError("these weights were released when the engine that loaded them was closed; load the "
                                 "model again (LLM(name)) or derive engines before closing it")
            weight = next(model.model.parameters())
            if (weight.device.type, weight.dtype) != (device.type, dtype):
                raise ValueError(f"the loaded weights are {weight.dtype} on {weight.device}, the engine asks for "
                                 f"{dtype} on {device}; derive an engine with the same device and dtype")
            loaded = model
        else:
            if not isinstance(model, str):
                raise ValueError(f"model must be a name ('tiny-random', 'smollm2-135m'), a checkpoint directory, "
                                 f"a .gguf file or a hub id, got {type(model).__name__} {model!r}")
            loaded = load_model(model, device, dtype)
        if device.type == "cuda":  # what a closed or deleted engine left in PyTorch's cache counts as free
            torch.cuda.empty_cache()
        runner_cls = ModelRunner
        if cfg.tensor_parallel_size > 1:  # rung 12: this process is rank 0 (minikv/engine/parallel.py)
            from minikv.engine.parallel import tensor_parallel_engine

            loaded, cfg, runner_cls = tensor_parallel_engine(model, loaded, cfg)
        else:
            cfg = fit_to_model(cfg, loaded)
        if cfg.chosen and device.type == "cuda":
            _say_once(f"minikv: {cfg.kv_backend} engine fitted to the device: "
                      + ", ".join(f"{name}={getattr(cfg, name):,}" for name in cfg.chosen)
                      + " (pass any of them to LLM(...) to override)")
        self.core = EngineCore(loaded, cfg, runner_cls)
        self.core.observed_as(self)
        self.loaded, self.engine_config = loaded, cfg
        self._owns_weights = loaded is not model  # loaded here (not handed another engine's weights)
        loaded.engines.add(self)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.device, self.dtype, self.kv_backend, self.seed = cfg.device, cfg.dtype, cfg.kv_backend, cfg.seed
        self.max_model_len, self.attention, self.block_size = self.core.max_model_len, self.core.attention, \
            self.core.block_size
        self._lock = self.core.lock  # one step at a time: the core's lock, which the client's bookkeeping shares
        self._listeners: dict[str, tuple[deque, int]] = {}  # request id -> (its call's events, prompt index)
        self._last: list[Sequence] = []  # the requests of the last generate / stream / beam_search (stats)

    # ---- the core's parts, for tests and the course's white-box cells ------------------------------
    # (minikv's own views, checkers and the server read `view` instead; see minikv/engine/view.py)
    scheduler = property(lambda self: self.core.scheduler)
    block_manager = property(lambda self: self.core.block_manager)
    prefix_cache = property(lambda self: self.core.prefix_cache)
    backend = property(lambda self: self.core.backend)
    runner = property(lambda self: self.core.runner)
    offload_store = property(lambda self: self.core.offload_store)
    num_overlapped_steps = property(lambda self: self.core.num_overlapped_steps)

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request (unless ignore_eos): the model's EOS and the tokenizer's."""
        return self.core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.core.eos_token_ids = set(ids)

    @property
    def view(self):
        """A read-only view of the engine (pool usage, queues, cached blocks, tiers): minikv/engine/view.py."""
        return self.core.view

    @property
    def is_paged(self) -> bool:
        """A paged pool (rungs 4-7): block tables, the block manager, prefix caching, forks."""
        return self.core.is_paged

    @property
    def async_scheduling(self) -> bool:
        """Whether steps overlap (minikv/engine/overlap.py); may be switched on a running engine."""
        return self.core.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.core.async_scheduling = on

    def close(self, release_weights: bool | None = None) -> None:
        """Abort every request not finished yet (finish reason "abort": a stream of one gets its last
        event), queue the cached blocks not yet written through, finish the offload tiers' disk writes
        and stop the writer thread, then give back the memory the engine allocated: the KV pool, the
        swap space, the CPU tier, the CUDA graphs and staging buffers (on a GPU, to the driver too, so
        that the next engine sized from free memory sees it). Afterwards `step()`, `generate()` and
        `add_request()` raise CLOSED_MESSAGE. Idempotent; `with LLM(...) as llm:` calls it on leaving.

        The weights: release_weights=None gives them back on a GPU when this engine loaded them and no
        other open engine shares them (engines made by `derive()`); True does so on any device; False keeps
        them (`llm.loaded` then still builds engines). Kept weights go with the last engine on them (`del`:
        nothing in an engine holds a cycle back to it)."""
        if release_weights not in (None, True, False):
            raise ValueError(f"release_weights must be True, False or None (on a GPU), got {release_weights!r}")
        with self._lock:
            self.core.close()
            self._dispatch(self.core.take_events())
            shared = any(e is not self and not e.core.closed for e in self.loaded.engines)
            wanted = self.device.type == "cuda" if release_weights is None else release_weights
            if wanted and self._owns_weights and not shared and not self.loaded.released:
                self.loaded.release()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # on a GPU the weights go too, unless shared (see close)

    def derive(self, **changes) -> "LLM":
        """A new engine on the same loaded weights, with the same options except `changes`. This is how a
        checker runs your function beside the engine's own:

            mine = llm.derive(slot_mapping=my_slot_mapping)   # = LLM(same model, same options, slot_mapping=...)
        """
        if self.engine_config.tensor_parallel_size > 1:  # these weights are rank 0's slice: load them again
            return LLM(self.loaded.source, **{**self._options, **changes})
        return LLM(self.loaded, **{**self._options, **changes})

    def add_observer(self, observer) -> Callable[[], None]:
        """Watch every step: `observer.on_schedule(llm, batch)` once the scheduler picked the batch (before
        the model runs), `observer.on_step(llm, batch, events)` once the step is done, and
        `observer.on_event(llm, step, request_id, event)` for each scheduler event of a paged engine
        (arrive, load, admit, preempt, swap_out, swap_in, fork, finish, abort); any may be missing. Views and
        checkers use this instead of wrapping engine methods. Returns `remove()`."""
        return self.core.add_observer(observer)

    # ---- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[list[int], str | None, str | None]:
        """Return (token ids, text or None, cache salt or None) of one prompt, validated."""
        ids, text, salt = parse_prompt(prompt, self.tokenizer, self.config.vocab_size)  # minikv/engine/prompts.py
        self.core.check_length(len(ids))
        return ids, text, salt

    def chat_prompt(self, user_message: str, system: str | None = None) -> str:
        """Wrap a user message in the model's chat template (instruct models), ready to generate from."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return user_message
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_message}]
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                tenant: str | None = None) -> EngineRequest:
        """One prompt as the core takes it: tokenized, its form checked (a list of ints, a dict's keys, a
        salt); the core checks the ids' range and the length when it takes it (`core.new_sequence`)."""
        if self.core.closed:
            raise RuntimeError(CLOSED_MESSAGE)
        # the ids' range is the core's check (new_sequence, which every request meets next), made once
        ids, text, salt = parse_prompt(prompt, self.tokenizer, self.config.vocab_size, check_range=False)
        return EngineRequest(ids, params if params is not None else SamplingParams(), request_id, salt, text, tenant)

    def make_sequence(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """The sequence a prompt would run as, checked, not queued."""
        return self.core.new_sequence(self.request(prompt, params, request_id))

    # ---- running -------------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    tenant: str | None = None) -> Sequence:
        """Queue one request (validated now: a bad one raises and leaves the engine untouched).
        Drive the engine with `step()` until `has_unfinished()` is False. `tenant` names who sent it
        (schedule_policy="vtc" shares the engine fairly between tenants)."""
        return self.core.add(self.request(prompt, params, request_id, tenant))

    def has_unfinished(self) -> bool:
        """Requests still to run, or an overlapped step still on the device (its blocks still held)."""
        return self.core.has_unfinished()

    def step(self) -> list[tuple[Sequence, int, str]]:
        """One engine step (minikv/engine/core.py). Returns (sequence, new token, new text) for each
        sequence that sampled; the streams of `stream` and `generate` get their events."""
        with self._lock:
            try:
                return self.core.run_step()
            finally:
                self._dispatch(self.core.take_events())

    def abort(self, seq: Sequence) -> None:
        """Stop a request (all its samples) now; whatever cache it holds goes back. A stream of it gets a
        last event with finish_reason "abort"."""
        if not isinstance(seq, Sequence):
            raise ValueError(f"abort takes the Sequence that add_request returned, got {type(seq).__name__} {seq!r}")
        with self._lock:
            self.core.abort(seq)
            self._dispatch(self.core.take_events())

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

    def _submit(self, prompts, params) -> tuple[list[Sequence], deque[StreamEvent]]:
        """Check every request, then queue them all; their events will go to the returned queue."""
        prompts, params = pair_requests(prompts, params)
        requests = [self.request(p, sp) for p, sp in zip(prompts, params)]
        seqs = [self.core.new_sequence(r) for r in requests]  # every one checked before any is queued
        events: deque[StreamEvent] = deque()
        with self._lock:
            self.core.reset_sharing_stats()
            self.core.enqueue(seqs)
            for i, seq in enumerate(seqs):
                self._listeners[seq.request_id] = (events, i)
        return seqs, events

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
                    self.core.abort(seq)
                self._dispatch(self.core.take_events())
                for seq in seqs:
                    self._listeners.pop(seq.request_id, None)
                self._last = seqs

    def _dispatch(self, events: list[EngineEvent]) -> None:
        """Hand each event to the call that submitted its request (if a `stream` or `generate` did)."""
        for e in events:
            listener = self._listeners.get(e.request_id)
            if listener is not None:
                queue, i = listener
                queue.append(StreamEvent(i, e.request_id, e.token_id, e.text_delta, e.finished, e.finish_reason,
                                         sample_index=e.index))

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
        max_seqs = self.engine_config.max_num_seqs
        if not isinstance(beam_width, int) or not 1 <= beam_width <= max_seqs:
            raise ValueError(f"beam_width must be an integer in [1, max_num_seqs={max_seqs}], "
                             f"got {beam_width!r}; raise max_num_seqs for wider beams")
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # beams stop by BeamSearch's rules
        prompts, params = pair_requests(prompts, params)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        searches = [BeamSearch(s, beam_width, max_tokens, self.eos_token_ids, ignore_eos, self.max_model_len)
                    for s in seqs]
        self._last = seqs
        try:
            self.core.run_beam_search(seqs, searches)
        finally:
            self.core.take_events()  # nobody streams beams
        outs = []
        for seq, search in zip(seqs, searches):
            beams = [CompletionOutput(i, h.token_ids, self._decode(h.token_ids), h.finish_reason, h.cumulative_logprob)
                     for i, h in enumerate(search.results(length_penalty))]
            best = search.results(length_penalty)[0]
            metrics = RequestMetrics(seq.arrival_time, best.token_times)
            outs.append(RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, list(best.token_ids),
                                      beams[0].text, best.finish_reason, metrics, outputs=beams))
        return outs

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ---- prefix cache (rung 6) ----------------------------------------------------------------
    def reset_prefix_cache(self, defer: bool = False) -> bool:
        """Forget every cached block: call it after changing the weights (cached K/V would be stale).

        Refused with an error while running requests hold cached blocks. With defer=True it waits
        instead: no hits and no new entries from now on, and the cache is cleared as soon as no
        request holds KV blocks. Returns True if the cache was cleared now."""
        return self.core.reset_prefix_cache(defer)

    def pin_prefix(self, prompt: Prompt) -> int:
        """Keep the cached blocks of this prompt's prefix (a system prompt, say) from ever being evicted.
        Computes the prompt first if it is not cached yet. Returns the number of tokens pinned (whole
        blocks: a partial last block is never cached). Undo with `unpin_prefix`. Pinned blocks count
        against every later request: one that could not fit beside them is refused when submitted."""
        self.core._need_prefix_cache("pin_prefix")
        ids, _, salt = self.encode(prompt)
        with self._lock:
            try:
                return self.core.pin_prefix(ids, salt)
            finally:
                self._dispatch(self.core.take_events())

    def unpin_prefix(self, prompt: Prompt) -> int:
        """Let the pinned blocks of this prefix be evicted again. Returns the number of tokens unpinned."""
        self.core._need_prefix_cache("unpin_prefix")
        ids, _, salt = self.encode(prompt)
        return self.core.unpin_prefix(ids, salt)

    # ---- results -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """KV usage, preemptions, swap traffic, and per-request latency of the last generate()."""
        out = self.core.stats()
        if self.engine_config.tensor_parallel_size > 1:  # each rank's heads and pool
            out["tensor_parallel"] = self.core.runner.stats()
        prefix = out.pop("prefix_cache", None)
        out["requests"] = [
            {"request_id": s.request_id, "time_to_first_token": o.time_to_first_token,
             "inter_token_latency": o.inter_token_latency, "num_preemptions": s.num_preemptions,
             "num_cached_tokens": s.num_cached_tokens}
            for s in self._last for o in [self.output(s)]
        ]
        if prefix is not None:  # the time to first token of the last call's hits and misses (median, seconds)
            ttft = {hit: sorted(r["time_to_first_token"] for r in out["requests"]
                                if r["time_to_first_token"] is not None and (r["num_cached_tokens"] > 0) == hit)
                    for hit in (True, False)}
            prefix["ttft_hit_median_s"] = ttft[True][len(ttft[True]) // 2] if ttft[True] else None
            prefix["ttft_miss_median_s"] = ttft[False][len(ttft[False]) // 2] if ttft[False] else None
            out["prefix_cache"] = prefix
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
            num_accepted_tokens=seq.num_accepted_tokens,
            num_drafted_tokens=seq.num_drafted_tokens,
        )
