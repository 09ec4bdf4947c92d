"""The handful of numbers that define a Llama-family decoder, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder minikv can run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Llama-3 style: factor, low/high_freq_factor, ...
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 puts a bias on q, k and v
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_type: str = "llama"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in fp32, over all layers (2 x layers x kv_heads x head_dim x 4)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a config.json dict (transformers 4.x and 5.x spellings); `source` names the file in errors."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = cfg.get("architectures") or [model_type or "unknown"]
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({', '.join(archs)}) is not supported; minikv runs "
                f"Llama-family decoders: {', '.join(SUPPORTED_ARCHITECTURES)}. "
                "Pick a checkpoint of one of those architectures."
            )
        check_sizes(cfg, source)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 nests rope settings under "rope_parameters"; 4.x uses rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise UnsupportedModelError(
                    f"rope scaling {kind!r} is not supported (only 'llama3'); use a checkpoint without it"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )


def check_sizes(cfg: dict[str, Any], source: str) -> None:
    """Every size the decoder is built from is present and a positive integer, and the heads divide evenly."""
    missing = [k for k in REQUIRED_FIELDS if k not in cfg]
    if missing:
        raise ValueError(f"{source} is missing {', '.join(map(repr, missing))}; a Llama-family config needs "
                         f"{', '.join(REQUIRED_FIELDS)}: download the checkpoint's config.json again")
    for k in REQUIRED_FIELDS + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        v = cfg.get(k)
        if k in cfg and v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{source}: {k} must be a positive integer, got {v!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ValueError(f"{source}: hidden_size {cfg['hidden_size']} is not a multiple of num_attention_heads "
                         f"{heads}; give head_dim")
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
                         "(each KV head serves a whole group of query heads)")
