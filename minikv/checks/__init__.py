"""The exercise checkers: run a learner's function against the engine's own code and explain the first
difference (which case, which position, which head, expected vs got)."""
from minikv.checks.attention import (
    check_causal_attention,
    check_causal_attention_in_engine,
    check_decode_step,
    check_decode_step_in_engine,
)
from minikv.checks.report import first_difference

__all__ = [
    "check_causal_attention",
    "check_causal_attention_in_engine",
    "check_decode_step",
    "check_decode_step_in_engine",
    "first_difference",
]
