"""minikv: a small, real LLM inference engine, built rung by rung to teach the KV cache."""
from minikv.engine import LLM, RequestOutput, SamplingParams, StreamEvent

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
__version__ = "0.1.0"
