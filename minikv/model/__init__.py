"""Rung 0: the model. A Llama-family decoder in plain torch and the ways to load one."""
from minikv.model.config import ModelConfig, UnsupportedModelError
from minikv.model.dtype import parse_dtype
from minikv.model.llama import LlamaForCausalLM
from minikv.model.loader import LoadedModel, load_model
from minikv.model.named import NAMED_MODELS, cache_dir, prepare_smollm2

__all__ = ["ModelConfig", "UnsupportedModelError", "LlamaForCausalLM", "LoadedModel", "load_model",
           "NAMED_MODELS", "cache_dir", "prepare_smollm2", "parse_dtype"]
