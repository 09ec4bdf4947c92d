"""GGUF files (llama.cpp's format): checked, converted once through transformers, cached by content.

    /any/folder/model.gguf  --sha256 of the bytes-->  $MINIKV_CACHE/gguf/model-3f2a9c0e1b7d4a65/
                                                       config.json, model.safetensors, tokenizer files

The cache is keyed by the file's content, not its name: two different files both called model.gguf
never share a conversion, and a file changed in place is converted again. The key is a full sha256:
exact, and cheap beside what follows it (hashing runs at about a GB/s, while the de-quantized copy
that is loaded next is several times larger than the quantized GGUF file).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from minikv.model.paths import writable_dir

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file


def check_gguf(path: Path) -> None:
    """Refuse, naming the path, a file that is not GGUF (before transformers fails on it obscurely)."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes), not a GGUF model; download or copy it again")
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}; "
                         "pass a .gguf model, or a checkpoint directory (config.json + *.safetensors)")


def content_key(path: Path) -> str:
    """The first 16 hex digits of the file's sha256 (64 bits: two different files never meet)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()[:16]


def converted_gguf(path: Path, cache: Path) -> Path:
    """The checkpoint directory converted from the GGUF file at `path`, converting it on first use."""
    check_gguf(path)
    out = cache / "gguf" / f"{path.stem}-{content_key(path)}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    writable_dir(out.parent)
    tmp = out.with_name(out.name + ".partial")  # a conversion cut short is never taken for a finished one
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(path.parent, path.name, tmp)
    except Exception as e:  # noqa: BLE001  the GGUF reader fails deep inside ("cannot reshape array ...")
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"could not convert {path} ({kind(e)}: {first_line(e)}); the file is truncated, "
                         "corrupt or not a Llama-family model: download or copy it again") from e
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def kind(e: BaseException) -> str:
    """The exception's class, with its module unless built in ("struct.error", not "error")."""
    cls = type(e)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def first_line(e: BaseException, limit: int = 200) -> str:
    """An exception's message on one line, cut to `limit` characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def convert_gguf(src_dir: Path, gguf_file: str, out_dir: Path) -> None:
    """Load a GGUF checkpoint through transformers and write config.json + safetensors + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the copy is de-quantized fp32
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared with the embedding
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(out_dir)
