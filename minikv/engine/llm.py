"""The public face of the engine: `LLM(model, ...)`, `generate`, `stream`.

    llm = LLM("smollm2-135m", kv_backend="contiguous")
    out = llm.generate(["The KV cache is"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].time_to_first_token)

One engine step = schedule -> prepare one flattened batch -> model -> sample -> update.
"""
from __future__ import annotations

from typing import Iterator

import torch

from minikv.attention.contiguous import ContiguousBackend
from minikv.attention.naive import NaiveBackend
from minikv.attention.paged import KV_LAYOUTS, PagedBackend
from minikv.cache.block_manager import BlockManager
from minikv.cache.prefix_cache import EVICTION_POLICIES, PrefixCache
from minikv.cache.prefix_caches import make_prefix_cache
from minikv.cache.swap import SwapSpace
from minikv.engine.beam import BeamSearch, take_beam_rows
from minikv.engine.cuda_graph import DecodeGraphs
from minikv.engine.detokenizer import detokenize
from minikv.engine.fork import clone, fork_samples, sample_generator, samples_of
from minikv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamEvent
from minikv.engine.prompts import parse_prompt
from minikv.engine.runner import ModelRunner
from minikv.engine.sampler import sample
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.scheduler import PREEMPTION_MODES, Scheduler
from minikv.engine.sequence import Sequence, SequenceStatus
from minikv.engine.simple_scheduler import SimpleScheduler
from minikv.model.loader import load_model

KV_BACKENDS = ("naive", "contiguous", "paged")
ATTENTION_IMPLS = ("torch", "triton")
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 4, 1024
PREFIX_CACHING = ("hash", "radix")
SCHEDULE_POLICIES = ("fcfs", "lpm")

Prompt = str | list[int] | dict


def pair_requests(prompts, params) -> tuple[list[Prompt], list[SamplingParams]]:
    """One prompt or a list of them, with one SamplingParams for all or one each -> two equal lists."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    params = params if params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; give one, or one per prompt")
    return list(prompts), list(params)


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m",
        device: str | None = None,
        dtype: torch.dtype | str | None = None,
        kv_backend: str = "contiguous",
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int = 0,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        preemption: str = "recompute",
        swap_blocks: int | None = None,
        block_allocator=None,
        attention: str | None = None,
        kv_layout: str | None = None,
        cuda_graphs: bool | None = None,
        prefix_caching: str | PrefixCache | None = None,
        eviction: str = "lru",
        schedule_policy: str = "fcfs",
    ):
        """kv_backend: "naive" (rung 1), "contiguous" (rung 2) or "paged" (rungs 4-5).

        Paged options: block_size (tokens per block, a power of two), num_blocks or kv_cache_memory
        (bytes) for the pool, max_num_seqs, max_num_batched_tokens (token budget per step),
        enable_chunked_prefill, preemption ("recompute" or "swap"), swap_blocks (CPU swap space,
        default num_blocks), block_allocator (a class called with num_blocks, see minikv.cache),
        attention ("torch" reference or "triton" kernels; default: "triton" for a paged pool on a GPU,
        where it is measured faster, see benchmarks/RESULTS.md, and "torch" otherwise), kv_layout (the
        pool's storage order: "nhd" token-major or "hnd" head-major; default: the attention's own,
        "nhd" for torch, "hnd" for triton; indexing is the same either way), cuda_graphs (decode
        steps replayed from CUDA graphs, one per batch-size bucket; default on with triton attention
        on a GPU, see minikv/engine/cuda_graph.py).

        Prefix caching (rung 6, paged only): prefix_caching None (off), "hash" (vLLM's hashed block
        chain) or "radix" (SGLang's radix tree); eviction "lru" or "fifo" (which unused cached block
        goes first); schedule_policy "fcfs" or "lpm" (longest cached prefix first). Requests with
        different `cache_salt` never share cached blocks.
        """
        if kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {kv_backend!r}; choose one of {', '.join(KV_BACKENDS)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if attention is None:
            attention = "triton" if kv_backend == "paged" and self.device.type == "cuda" else "torch"
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
        if attention == "triton" and kv_backend != "paged":
            raise ValueError("attention='triton' runs on the paged pool; use kv_backend='paged'")
        if kv_layout is not None and kv_backend != "paged":
            raise ValueError("kv_layout is the storage order of the paged pool's blocks; use kv_backend='paged'")
        if kv_layout is not None and kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True, False or None (on where supported), got {cuda_graphs!r}")
        if cuda_graphs and (self.device.type != "cuda" or attention != "triton" or kv_backend != "paged"):
            raise ValueError(f"cuda_graphs replays decode steps of the Triton kernels on a GPU (here: device "
                             f"{self.device.type}, attention {attention!r}, kv_backend {kv_backend!r}); "
                             "use kv_backend='paged', attention='triton' on a CUDA device, or cuda_graphs=False")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {preemption!r}")
        if prefix_caching is not None and kv_backend != "paged":
            raise ValueError("prefix caching shares KV blocks between requests; use kv_backend='paged'")
        if isinstance(prefix_caching, str) and prefix_caching not in PREFIX_CACHING:
            raise ValueError(f"prefix_caching must be None or one of {', '.join(PREFIX_CACHING)}, got {prefix_caching!r}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {schedule_policy!r}")
        if schedule_policy == "lpm" and prefix_caching is None:
            raise ValueError("schedule_policy='lpm' orders requests by their cached prefix; turn prefix_caching on")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        loaded = load_model(model, self.device, self.dtype)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        limit = self.config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {limit} positions; lower it")
        self.max_model_len = max_model_len or min(limit, 2048)
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.kv_backend = kv_backend
        self.attention = attention if kv_backend == "paged" else None
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        c = self.config
        self.block_size = None
        if kv_backend == "naive":
            self.backend = NaiveBackend(c.sliding_window)
            self.scheduler = SimpleScheduler(self.backend, max_num_seqs or 1)
        elif kv_backend == "contiguous":
            max_num_seqs = max_num_seqs or 4
            self.backend = ContiguousBackend(c.num_layers, max_num_seqs, self.max_model_len, c.num_kv_heads,
                                             c.head_dim, self.dtype, self.device, c.sliding_window)
            self.scheduler = SimpleScheduler(self.backend, max_num_seqs)
        else:
            self._build_paged(block_size, num_blocks, kv_cache_memory, max_model_len, max_num_seqs or 32,
                              max_num_batched_tokens, enable_chunked_prefill, preemption, swap_blocks,
                              block_allocator, attention, kv_layout)
        graphs = None
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.attention == "triton"
        if cuda_graphs:
            graphs = DecodeGraphs(self.model, self.backend, self.device, self.block_size, self.scheduler.max_num_seqs,
                                  self.max_model_len, c.vocab_size)
            with torch.inference_mode():
                graphs.capture_all()
        self.runner = ModelRunner(self.model, self.backend, self.device, self.block_size, graphs)
        self._last: list[Sequence] = []
        self.prefix_cache: PrefixCache | None = None
        self._reset_pending = False
        if prefix_caching is not None:
            self.prefix_cache = make_prefix_cache(prefix_caching, self.block_size, eviction)
            self.block_manager.attach_prefix_cache(self.prefix_cache)
            self.scheduler.policy = schedule_policy

    def _build_paged(self, block_size, num_blocks, kv_cache_memory, max_model_len, max_num_seqs,
                     max_num_batched_tokens, chunked, preemption, swap_blocks, block_allocator, attention,
                     kv_layout=None) -> None:
        c = self.config
        if not isinstance(block_size, int) or block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}")
        per_block = PagedBackend.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, self.dtype)
        if num_blocks is None:
            if kv_cache_memory is None:
                if self.device.type == "cuda":
                    kv_cache_memory = int(torch.cuda.mem_get_info(self.device)[0] * 0.5)
                else:
                    kv_cache_memory = 256 * 2**20
            num_blocks = kv_cache_memory // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={kv_cache_memory:,} bytes holds no block of {per_block:,} bytes "
                                 f"(block_size {block_size}); give more memory or a smaller block_size")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        capacity = num_blocks * block_size
        if max_model_len is None:
            self.max_model_len = min(self.max_model_len, capacity)
        elif max_model_len > capacity:
            raise ValueError(
                f"num_blocks={num_blocks} x block_size={block_size} holds {capacity:,} tokens, too small for one "
                f"request of max_model_len={max_model_len:,}; raise num_blocks (or kv_cache_memory) to at least "
                f"{-(-max_model_len // block_size)}, or lower max_model_len")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 512 if chunked else self.max_model_len
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}")
        if not chunked and max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len={self.max_model_len}: "
                "without chunked prefill a whole prompt must fit one step. Raise max_num_batched_tokens, lower "
                "max_model_len, or set enable_chunked_prefill=True")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if attention == "triton":
            from minikv.attention.triton_backend import TritonPagedBackend as backend_cls
        else:
            backend_cls = PagedBackend
        self.backend = backend_cls(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim,
                                   self.dtype, self.device, c.sliding_window, kv_layout)
        if block_allocator is not None and isinstance(block_allocator, type):
            block_allocator = block_allocator(num_blocks)
        self.block_manager = BlockManager(num_blocks, block_size, block_allocator)
        swap = None
        if preemption == "swap":
            swap = SwapSpace(self.backend, swap_blocks if swap_blocks is not None else num_blocks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, chunked, preemption, swap)
        self.block_size = block_size

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
        ids, text, salt = self.encode(prompt)
        seq = Sequence(ids, params, request_id=request_id, cache_salt=salt, prompt=text)
        seq.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else self._generator
        if params.n > 1:
            if self.block_size is not None:  # paged: prefill once, then fork (minikv/engine/fork.py)
                if params.n > self.scheduler.max_num_seqs:
                    raise ValueError(f"n={params.n} parallel samples run at once but max_num_seqs is "
                                     f"{self.scheduler.max_num_seqs}; raise max_num_seqs or lower n")
                seq.num_pending_forks = params.n - 1
            else:  # no blocks to share: n independent sequences, each prefilled on its own
                for i in range(1, params.n):
                    sample = clone(seq, i)
                    sample.generator = sample_generator(seq, i, self._generator)
                    seq.forks.append(sample)
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Sequence:
        """Queue one request (validated now: a bad one raises and leaves the engine untouched).
        Drive the engine with `step()` until `has_unfinished()` is False."""
        seq = self.make_sequence(prompt, params or SamplingParams(), request_id)
        for s in samples_of(seq):
            self.scheduler.add(s)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Yield a StreamEvent for every generated token of every request, as the engine makes it."""
        seqs = self._submit(prompts, params)
        self._last = seqs
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        try:
            while self.scheduler.has_unfinished():
                for seq, token, delta in self.step():
                    if seq.root.seq_id in index:  # requests queued earlier with add_request run too
                        yield StreamEvent(index[seq.root.seq_id], seq.root.request_id, token, delta,
                                          seq.is_finished, seq.finish_reason, sample_index=seq.index)
        finally:  # a consumer that stops early must not leave requests holding cache
            for seq in seqs:
                self.abort(seq)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        for _ in self.stream(prompts, params):
            pass
        return [self.output(s) for s in self._last]

    def _submit(self, prompts, params) -> list[Sequence]:
        prompts, params = pair_requests(prompts, params)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all before queuing any
        if self.block_size is not None:
            self.block_manager.reset_sharing_stats()
        for seq in seqs:
            for s in samples_of(seq):
                self.scheduler.add(s)
        return seqs

    def step(self) -> list[tuple[Sequence, int, str]]:
        """One engine step. Returns (sequence, new token, new text) for each sequence that sampled."""
        batch = self.scheduler.schedule()
        while not batch and self.block_size is not None and self.scheduler.preempt_stalled():
            batch = self.scheduler.schedule()  # stalled beams made room for a waiting sequence
        if not batch:
            if self.scheduler.has_unfinished():  # never spin: say what is stuck
                raise RuntimeError(f"the scheduler could run nothing this step while requests wait "
                                   f"({self.scheduler.__class__.__name__}: {self.stats()}); is the block allocator "
                                   "returning freed blocks?")
            return []
        logits, rows = self.runner.run(batch)
        seqs = [batch.seqs[r] for r in rows]
        searches = []
        if self.block_size is not None:
            seqs, logits = fork_samples(self.scheduler, seqs, logits, self._generator)  # n > 1: prompt done
            seqs, logits, searches = take_beam_rows(seqs, logits)  # beams are not sampled: they are ranked
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs]) if seqs else []
        events = [(seq, tok, self._append(seq, tok)) for seq, tok in zip(seqs, tokens)]
        self.scheduler.update(batch)
        for search in searches:
            search.advance(self.scheduler)
        if self._reset_pending and not self._holds_blocks():
            self.reset_prefix_cache()  # the deferred reset: no request holds blocks any more
        return events

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
        if self.block_size is None:
            raise ValueError("beam search shares blocks between beams: use kv_backend='paged'")
        if not isinstance(beam_width, int) or not 1 <= beam_width <= self.scheduler.max_num_seqs:
            raise ValueError(f"beam_width must be an integer in [1, max_num_seqs={self.scheduler.max_num_seqs}], "
                             f"got {beam_width!r}; raise max_num_seqs for wider beams")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)  # beams stop by BeamSearch's rules
        seqs = [self.make_sequence(p, params) for p in prompts]
        searches = [BeamSearch(s, beam_width, max_tokens, self.eos_token_ids, ignore_eos, self.max_model_len)
                    for s in seqs]
        self.block_manager.reset_sharing_stats()
        for s in seqs:
            self.scheduler.add(s)
        self._last = seqs
        try:
            while not all(search.done for search in searches):
                self.step()
        finally:  # an error mid-way must not leave beams holding cache
            for search in searches:
                for beam in search.beams:
                    if not beam.is_finished:
                        beam.status, beam.finish_reason = SequenceStatus.FINISHED, "abort"
                        self.scheduler.abort(beam)
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
        """Stop a request (all its samples) now; whatever cache it holds goes back."""
        for s in samples_of(seq):
            if not s.is_finished:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "abort"
                self.scheduler.abort(s)

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
        return True

    def _holds_blocks(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.swapped)

    def pin_prefix(self, prompt: Prompt) -> int:
        """Keep the cached blocks of this prompt's prefix (a system prompt, say) from ever being evicted.
        Computes the prompt first if it is not cached yet. Returns the number of tokens pinned (whole
        blocks: a partial last block is never cached). Undo with `unpin_prefix`."""
        cache = self._need_prefix_cache("pin_prefix")
        ids, _, salt = self.encode(prompt)
        full = len(ids) // self.block_size * self.block_size
        if cache.match(ids, salt).num_tokens < full and cache.enabled:
            self.generate({"prompt_token_ids": ids, "cache_salt": salt}, SamplingParams(max_tokens=1))
        return cache.pin(ids, salt)

    def unpin_prefix(self, prompt: Prompt) -> int:
        """Let the pinned blocks of this prefix be evicted again. Returns the number of tokens unpinned."""
        ids, _, salt = self.encode(prompt)
        return self._need_prefix_cache("unpin_prefix").unpin(ids, salt)

    def stats(self) -> dict:
        """KV usage, preemptions, swap traffic, and per-request latency of the last generate()."""
        out: dict = {"kv_backend": self.kv_backend}
        if self.block_size is not None:
            bm, sch = self.block_manager, self.scheduler
            out.update(
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
            )
        out["requests"] = [
            {"request_id": s.request_id, "time_to_first_token": o.time_to_first_token,
             "inter_token_latency": o.inter_token_latency, "num_preemptions": s.num_preemptions,
             "num_cached_tokens": s.num_cached_tokens}
            for s in self._last for o in [self.output(s)]
        ]
        if self.prefix_cache is not None:  # queries and hits count tokens, summed over admissions
            out["prefix_cache"] = self.prefix_cache.stats()
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
