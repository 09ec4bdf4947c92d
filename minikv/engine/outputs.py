"""What the engine hands back: one RequestOutput per request, and stream events as tokens come."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    token_times: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submission to the first generated token."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def inter_token_latency(self) -> float | None:
        """Mean seconds between consecutive generated tokens (None with fewer than two)."""
        gaps = self.inter_token_latencies
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def e2e_latency(self) -> float | None:
        return self.token_times[-1] - self.arrival_time if self.token_times else None


@dataclass
class CompletionOutput:
    """One completion of a request: one of its n parallel samples, or one of its final beams."""

    index: int  # which sample / beam (beams: 0 = the best)
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cumulative_logprob: float | None = None  # beam search: sum of the log-probabilities of token_ids


@dataclass
class RequestOutput:
    """The result of one request.

    `token_ids`, `text` and `finish_reason` are those of its first completion. With
    `SamplingParams(n=...)` or `LLM.beam_search`, `outputs` holds every completion, as in vLLM's
    RequestOutput: `out.outputs[i].text` is the i-th sample (or the i-th best beam), and
    `out.text == out.outputs[0].text`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" (EOS or a stop string), "length" (max_tokens / max_model_len), "abort"
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_accepted_tokens: int = 0  # speculative decoding: draft tokens the target kept
    num_drafted_tokens: int = 0  # and the draft tokens it verified

    @property
    def time_to_first_token(self) -> float | None:
        return self.metrics.time_to_first_token

    @property
    def inter_token_latency(self) -> float | None:
        return self.metrics.inter_token_latency


@dataclass
class StreamEvent:
    """One generated token of one request, as it comes. An aborted request ends with an event whose
    token_id is None, finished True and finish_reason "abort"."""

    index: int  # position of the request in the list given to LLM.stream / LLM.generate
    request_id: str
    token_id: int | None
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    sample_index: int = 0  # which of the request's n parallel samples
