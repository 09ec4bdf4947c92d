"""How one request wants its tokens chosen and when it stops. Validated when built: a bad value is a
ValueError naming the argument and the fix, before the request reaches the engine."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

# Below 1e-5 (vLLM's sampling epsilon too) softmax(logits / T) is already greedy to float32 precision:
# two logits 1e-3 apart differ by exp(-100) in probability. Far smaller values break the arithmetic
# itself: logits / 1e-45 overflows to inf and the softmax turns to nan. Temperature 0 means greedy.
MIN_TEMPERATURE = 1e-5
# sample i of a request draws from seed + i (minikv/engine/fork.py): seed + n - 1 must fit a signed
# 64-bit integer, which torch's generators, numpy and a JSON client all carry
MAX_SEED = 2**63 - 1


def is_int(x) -> bool:
    """An integer of any kind (numpy's too), not a bool: True is an int to Python, not to us. A plain int is
    answered first, without the ABC's check (the server asks this of every field of every request)."""
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def is_real(x) -> bool:
    """A real number of any kind, not a bool (plain floats and ints first, as `is_int`)."""
    return type(x) is float or type(x) is int or (isinstance(x, Real) and not isinstance(x, bool))


@dataclass
class SamplingParams:
    """Greedy when temperature == 0; otherwise softmax(logits / temperature) cut by top_k and top_p.

    max_tokens   new tokens at most (the request also stops at EOS, a stop string or max_model_len)
    seed         per-request seed: the same seed gives the same sample, whatever else is batched
    ignore_eos   keep going past EOS (benchmarks use it to fix the output length)
    stop         strings that end the output when generated (not included in the text); None = none
    n            parallel samples of one prompt (they share the prompt's KV blocks when paged)

    The engine takes a copy when it takes a request: changing this object afterwards changes no request
    already added (one object shared by many prompts, as `generate` shares it, is fine).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)  # a string, a list of strings or None
    n: int = 1
    priority: int = 0  # lower value = more important (kept longest under preemption)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            setattr(self, name, int(value))
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature {t!r} is below {MIN_TEMPERATURE}: logits / temperature overflows, and "
                             "sampling is already greedy there; use temperature=0 for greedy")
        self.temperature = float(t)
        p = self.top_p
        if not is_real(p) or not 0.0 < p <= 1.0:  # nan fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}; use 1.0 to disable it")
        self.top_p = float(p)
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it; vLLM's -1 is 0 here), got {self.top_k!r}")
        self.top_k = int(self.top_k)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.stop = self._stop_list(self.stop)
        if not is_int(self.priority):
            raise ValueError(f"priority must be an integer (lower = more important, default 0), got {self.priority!r}")
        self.priority = int(self.priority)
        if self.seed is not None:
            top = MAX_SEED - (self.n - 1)
            if not is_int(self.seed) or not 0 <= self.seed <= top:
                raise ValueError(f"seed must be None or an integer in [0, 2**63 - n] = [0, {top}] (sample i of n "
                                 f"draws from seed + i), got {self.seed!r}")
            self.seed = int(self.seed)

    @staticmethod
    def _stop_list(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        return list(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
