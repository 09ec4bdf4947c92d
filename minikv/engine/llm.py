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
from minikv.engine.outputs import RequestMetrics, RequestOutput, StreamEvent
from minikv.engine.runner import ModelRunner
from minikv.engine.sampler import sample
from minikv.engine.sampling_params import SamplingParams
from minikv.engine.sequence import Sequence, SequenceStatus
from minikv.engine.simple_scheduler import SimpleScheduler
from minikv.model.loader import load_model

KV_BACKENDS = ("naive", "contiguous")

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
    ):
        if kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {kv_backend!r}; choose one of {', '.join(KV_BACKENDS)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        loaded = load_model(model, self.device, self.dtype)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        limit = self.config.max_position_embeddings
        self.max_model_len = max_model_len or min(limit, 2048)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions; lower it")
        self.eos_token_ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.kv_backend = kv_backend
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        c = self.config
        if kv_backend == "naive":
            self.backend = NaiveBackend(c.sliding_window)
            max_num_seqs = max_num_seqs or 1
        else:
            max_num_seqs = max_num_seqs or 4
            self.backend = ContiguousBackend(c.num_layers, max_num_seqs, self.max_model_len, c.num_kv_heads,
                                             c.head_dim, self.dtype, self.device, c.sliding_window)
        self.scheduler = SimpleScheduler(self.backend, max_num_seqs)
        self.runner = ModelRunner(self.model, self.backend, self.device)

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

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """Yield a StreamEvent for every generated token of every request, as the engine makes it."""
        seqs = self._submit(prompts, params)
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
