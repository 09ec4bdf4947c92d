"""How one request wants its tokens chosen and when it stops. Validated when built."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Greedy when temperature == 0; otherwise softmax(logits / temperature) cut by top_k and top_p.

    max_tokens   new tokens at most (the request also stops at EOS, a stop string or max_model_len)
    seed         per-request seed: the same seed gives the same sample, whatever else is batched
    ignore_eos   keep going past EOS (benchmarks use it to fix the output length)
    stop         strings that end the output when generated (not included in the text)
    n            parallel samples of one prompt (they share the prompt's KV blocks when paged)
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    n: int = 1
    priority: int = 0  # lower value = more important (kept longest under preemption)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
