"""The engine: the EngineCore (the one place a step happens), the LLM facade over it, sequences,
schedulers, the model runner, the sampler."""
from minikv.engine.core import EngineCore, EngineEvent, EngineRequest
from minikv.engine.llm import LLM
from minikv.engine.outputs import RequestOutput, StreamEvent
from minikv.engine.sampling_params import SamplingParams

__all__ = ["EngineCore", "EngineEvent", "EngineRequest", "LLM", "RequestOutput", "SamplingParams", "StreamEvent"]
