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
from minikv.attention.paged import PagedBackend
from minikv.cache.block_manager import BlockManager
from minikv.cache.swap import SwapSpace
from minikv.engine.outputs import RequestMetrics, RequestOutput, StreamEvent
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

Prompt = str | list[int] | dict


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
        attention: str = "torch",
    ):
        """kv_backend: "naive" (rung 1), "contiguous" (rung 2) or "paged" (rungs 4-5).

        Paged options: block_size (tokens per block, a power of two), num_blocks or kv_cache_memory
        (bytes) for the pool, max_num_seqs, max_num_batched_tokens (token budget per step),
        enable_chunked_prefill, preemption ("recompute" or "swap"), swap_blocks (CPU swap space,
        default num_blocks), block_allocator (a class called with num_blocks, see minikv.cache),
        attention ("torch" reference or "triton" kernels).
        """
        if kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {kv_backend!r}; choose one of {', '.join(KV_BACKENDS)}")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
        if attention == "triton" and kv_backend != "paged":
            raise ValueError("attention='triton' runs on the paged pool; use kv_backend='paged'")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {preemption!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
                              block_allocator, attention)
        self.runner = ModelRunner(self.model, self.backend, self.device, self.block_size)
        self._last: list[Sequence] = []

    def _build_paged(self, block_size, num_blocks, kv_cache_memory, max_model_len, max_num_seqs,
                     max_num_batched_tokens, chunked, preemption, swap_blocks, block_allocator, attention) -> None:
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
                                   self.dtype, self.device, c.sliding_window)
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
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids' (and may have 'cache_salt')")
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model_type!r} was loaded without a tokenizer; "
                                 "pass prompts as lists of token ids")
            text = prompt
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty; give at least one token")
        if len(ids) > self.max_model_len:
            if self.block_size is not None and self.max_model_len == self.block_manager.num_blocks * self.block_size:
                raise ValueError(
                    f"prompt has {len(ids):,} tokens but the KV pool holds only {self.max_model_len:,} "
                    f"({self.block_manager.num_blocks} blocks x {self.block_size}); it can never fit: raise "
                    "num_blocks or kv_cache_memory, or shorten the prompt")
            raise ValueError(f"prompt has {len(ids):,} tokens but max_model_len is {self.max_model_len:,}; "
                             "raise max_model_len or shorten the prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
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
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Sequence:
        """Queue one request (validated now: a bad one raises and leaves the engine untouched).
        Drive the engine with `step()` until `has_unfinished()` is False."""
        seq = self.make_sequence(prompt, params or SamplingParams(), request_id)
        self.scheduler.add(seq)
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
                    yield StreamEvent(index[seq.seq_id], seq.request_id, token, delta, seq.is_finished, seq.finish_reason)
        finally:  # a consumer that stops early must not leave requests holding cache
            for seq in seqs:
                if not seq.is_finished:
                    self.abort(seq)
        self._last = seqs

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        for _ in self.stream(prompts, params):
            pass
        return [self.output(s) for s in self._last]

    def _submit(self, prompts, params) -> list[Sequence]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; give one, or one per prompt")
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]  # validate all before queuing any
        for s in seqs:
            self.scheduler.add(s)
        return seqs

    def step(self) -> list[tuple[Sequence, int, str]]:
        """One engine step. Returns (sequence, new token, new text) for each sequence that sampled."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():  # never spin: say what is stuck
                raise RuntimeError(f"the scheduler could run nothing this step while requests wait "
                                   f"({self.scheduler.__class__.__name__}: {self.stats()}); is the block allocator "
                                   "returning freed blocks?")
            return []
        logits, rows = self.runner.run(batch)
        seqs = [batch.seqs[r] for r in rows]
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        events = [(seq, tok, self._append(seq, tok)) for seq, tok in zip(seqs, tokens)]
        self.scheduler.update(batch)
        return events

    def _append(self, seq: Sequence, token: int) -> str:
        """Append a token, detokenize incrementally, apply the stop rules. Returns the new text."""
        import time

        seq.output_token_ids.append(token)
        seq.token_times.append(time.perf_counter())
        old = seq.text
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
                seq.text = text
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif p.stop and any(s in seq.text for s in p.stop):
            cut = min(seq.text.find(s) for s in p.stop if s in seq.text)
            seq.text = seq.text[:cut]
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            seq.status = SequenceStatus.FINISHED
        return seq.text[len(old):] if seq.text.startswith(old) else seq.text

    def abort(self, seq: Sequence) -> None:
        """Stop a request now; whatever cache it holds goes back."""
        if seq.is_finished:
            return
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.scheduler.abort(seq)

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
            )
        out["requests"] = [
            {"request_id": s.request_id, "time_to_first_token": o.time_to_first_token,
             "inter_token_latency": o.inter_token_latency, "num_preemptions": s.num_preemptions}
            for s in self._last for o in [self.output(s)]
        ]
        return out

    def output(self, seq: Sequence) -> RequestOutput:
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
        )
