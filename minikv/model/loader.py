"""Turn a model name, a checkpoint directory, a .gguf file or a hub id into a ready decoder.

    load_model("tiny-random")             seeded random Llama, built in code
    load_model("smollm2-135m")            the offline real model (see named.py)
    load_model("/path/to/checkpoint")     config.json + *.safetensors (tokenizer optional)
    load_model("/path/to/model.gguf")     through transformers' GGUF reader
    load_model("Qwen/Qwen2.5-0.5B")       a hub id, when you are online
"""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minikv.model.config import ModelConfig
from minikv.model.dtype import parse_dtype
from minikv.model.gguf import converted_gguf
from minikv.model.llama import LlamaForCausalLM, uninitialised_weights  # noqa: F401 - re-exported
from minikv.model.named import NAMED_MODELS, TINY_RANDOM_CONFIG, cache_dir, prepare_smollm2


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (prompts are then token ids)
    source: str
    # the engines built on these weights (weakly): the one that loaded them releases them on close()
    # when no other open engine shares them (LLM.close)
    engines: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False, compare=False)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["engines"] = None  # engines stay with their process; a copy starts with none
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, engines=weakref.WeakSet())

    @property
    def released(self) -> bool:
        """Whether the weights were given back (by the close() of the engine that loaded them)."""
        return next(self.model.parameters()).device.type == "meta"

    def release(self) -> None:
        """Give the weights' memory back (they move to the meta device: shapes without storage)."""
        self.model.to("meta")


def looks_like_a_path(name: str) -> bool:
    """"/x", "./x", "~/x", "a/b/c", "x.gguf" name local files; "org/name" may be a hub id, unless `org`
    is a local directory (then "models/tiny" is a path that does not exist, never a download)."""
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith(".gguf")
            or (name.count("/") == 1 and Path(name.split("/")[0]).expanduser().is_dir()))


def resolve(name_or_path: str | os.PathLike) -> tuple[Path | None, dict | None]:
    """Return (checkpoint directory, None) or (None, config dict) for `tiny-random`."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"model must be a name ({', '.join(NAMED_MODELS)}), a checkpoint directory, a .gguf file "
                         f"or a hub id, got {name_or_path!r}")
    name = os.fspath(name_or_path)
    if name == "tiny-random":
        return None, dict(TINY_RANDOM_CONFIG)
    if name == "smollm2-135m":
        return prepare_smollm2(), None
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file; pass the checkpoint directory that holds config.json and the "
                             "*.safetensors weights, or a .gguf file")
        return converted_gguf(path, cache_dir()), None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json; point at a Hugging Face checkpoint directory")
        return path, None
    if isinstance(name_or_path, os.PathLike) or looks_like_a_path(name):
        raise FileNotFoundError(f"model path {path} does not exist; check the path (or use a named model: "
                                f"{', '.join(NAMED_MODELS)})")
    if name.count("/") == 1:
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ValueError(f"could not fetch hub model {name!r} ({type(e).__name__}: {e}); "
                             f"go online, or pass a local checkpoint directory (there is no directory {path})") from e
        return Path(local), None
    raise ValueError(
        f"unknown model {name!r}: named models are {', '.join(NAMED_MODELS)}; "
        "otherwise pass a checkpoint directory, a .gguf file, or a hub id such as 'org/name'"
    )


def tiny_random_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Seeded weights wide enough that greedy argmax is decisive (no near-ties between backends)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5, generator=g)


def _read(file: Path, load) -> dict[str, torch.Tensor]:
    try:
        return load()
    except Exception as e:  # safetensors and torch say what broke, but not in which file
        raise ValueError(f"could not read the weights in {file} ({type(e).__name__}: {e}); the file is truncated "
                         "or corrupt: download or convert the checkpoint again") from e


def read_config(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; a broken file is a ValueError naming it."""
    file = ckpt / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); download the checkpoint again or fix the file") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object (the model's settings), got a {type(raw).__name__}")
    return raw


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(_read(f, lambda: load_file(str(f))))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(_read(f, lambda: torch.load(f, map_location="cpu", weights_only=True)))
        return state
    raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights; put the checkpoint's weight "
                            "files next to its config.json, or point at the whole checkpoint directory")


def load_model(name_or_path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = torch.float32) -> LoadedModel:
    dtype = parse_dtype(dtype, device)
    ckpt, raw_cfg = resolve(name_or_path)
    if raw_cfg is None:
        raw_cfg = read_config(ckpt)
    cfg = ModelConfig.from_hf(raw_cfg, source=str(ckpt / "config.json") if ckpt is not None else "tiny-random")
    if ckpt is None:
        model = LlamaForCausalLM(cfg)
        tiny_random_weights(model)
    else:
        with uninitialised_weights():  # the checkpoint overwrites every parameter (checked below)
            model = LlamaForCausalLM(cfg)
        state = read_state_dict(ckpt)
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {ckpt} does not match a {cfg.model_type} decoder: "
                f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        model.load_state_dict(state, strict=False)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = load_tokenizer(ckpt) if ckpt is not None else None
    return LoadedModel(model, cfg, tokenizer, name_or_path)


# tokenizer classes that are transformers' generic fast tokenizer, whose whole behaviour is in
# tokenizer.json: loaded as PreTrainedTokenizerFast, they skip AutoTokenizer, whose import of the model
# registry (configurations, activations, kernels) cost 3.6 s of every fresh process that loads SmolLM2
GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}


def load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None  # e.g. a freshly save_pretrained random model: prompts are token ids
    config = path / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if cls in GENERIC_TOKENIZERS and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
