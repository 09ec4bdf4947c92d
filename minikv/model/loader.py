"""Turn a model name, a checkpoint directory, a .gguf file or a hub id into a ready decoder.

    load_model("tiny-random")             seeded random Llama, built in code
    load_model("smollm2-135m")            the offline real model (see named.py)
    load_model("/path/to/checkpoint")     config.json + *.safetensors (tokenizer optional)
    load_model("/path/to/model.gguf")     through transformers' GGUF reader
    load_model("Qwen/Qwen2.5-0.5B")       a hub id, when you are online
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minikv.model.config import ModelConfig
from minikv.model.llama import LlamaForCausalLM
from minikv.model.named import NAMED_MODELS, TINY_RANDOM_CONFIG, cache_dir, convert_gguf, prepare_smollm2


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer, or None (prompts are then token ids)
    source: str


def resolve(name_or_path: str) -> tuple[Path | None, dict | None]:
    """Return (checkpoint directory, None) or (None, config dict) for `tiny-random`."""
    if name_or_path == "tiny-random":
        return None, dict(TINY_RANDOM_CONFIG)
    if name_or_path == "smollm2-135m":
        return prepare_smollm2(), None
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir() / "gguf" / path.stem
        if not (out / "model.safetensors").exists():
            convert_gguf(path.parent, path.name, out)
        return out, None
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json; point at a Hugging Face checkpoint directory")
        return path, None
    if name_or_path.count("/") == 1 and not path.exists():
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ValueError(f"could not fetch hub model {name_or_path!r} ({type(e).__name__}: {e}); "
                             "go online, or pass a local checkpoint directory") from e
        return Path(local), None
    raise ValueError(
        f"unknown model {name_or_path!r}: named models are {', '.join(NAMED_MODELS)}; "
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


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights")


def load_model(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LoadedModel:
    ckpt, raw_cfg = resolve(name_or_path)
    if raw_cfg is None:
        raw_cfg = json.loads((ckpt / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw_cfg)
    model = LlamaForCausalLM(cfg)
    if ckpt is None:
        tiny_random_weights(model)
    else:
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


def load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None  # e.g. a freshly save_pretrained random model: prompts are token ids
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
