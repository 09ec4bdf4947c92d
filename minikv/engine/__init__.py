"""The engine: sequences, schedulers, the model runner, the sampler and the LLM facade."""
from minikv.engine.llm import LLM
from minikv.engine.outputs import RequestOutput, StreamEvent
from minikv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
