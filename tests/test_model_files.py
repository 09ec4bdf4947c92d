"""Broken or mistaken model files are refused with an error naming the file and the fix, and a converted
GGUF is cached by its content, never by its name (issue 11, items 5 and 10)."""
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minikv.model import parse_dtype
from minikv.model.config import ModelConfig
from minikv.model.llama import LlamaForCausalLM
from minikv.model.loader import load_model, resolve, tiny_random_weights
from minikv.model.named import TINY_RANDOM_CONFIG


def write_checkpoint(path, **overrides):
    """A tiny-random-sized checkpoint directory: config.json + model.safetensors."""
    cfg = dict(TINY_RANDOM_CONFIG, **overrides)
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg))
    tiny_random_weights(model)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# ---- GGUF: cached by content, refused when not GGUF (item 5) ---------------------------------------

@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """Conversion without transformers: the 'model' written is a checkpoint whose vocab_size records
    which file it came from (its last byte), so a mix-up shows. Returns the list of files converted."""
    converted = []

    def convert(src_dir, gguf_file, out_dir):
        data = (src_dir / gguf_file).read_bytes()
        converted.append(src_dir / gguf_file)
        write_checkpoint(out_dir, vocab_size=300 + data[-1])

    monkeypatch.setattr("minikv.model.gguf.convert_gguf", convert)
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path / "cache"))
    return converted


def gguf(path, payload: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + payload)
    return path


def test_two_different_files_named_model_gguf_never_share_a_conversion(tmp_path, fake_conversion):
    a = gguf(tmp_path / "a" / "model.gguf", b"first" + bytes([1]))
    b = gguf(tmp_path / "b" / "model.gguf", b"other" + bytes([2]))
    assert load_model(str(a)).config.vocab_size == 301
    assert load_model(str(b)).config.vocab_size == 302  # before: the conversion of a, found by its name
    assert resolve(str(a))[0] != resolve(str(b))[0]
    assert fake_conversion == [a, b]  # and each was converted once: the second load of a hit the cache


def test_same_content_anywhere_is_converted_once_and_a_file_changed_in_place_again(tmp_path, fake_conversion):
    a = gguf(tmp_path / "a" / "model.gguf", b"same" + bytes([7]))
    copy = gguf(tmp_path / "elsewhere" / "model.gguf", b"same" + bytes([7]))
    assert resolve(str(a))[0] == resolve(str(copy))[0] and fake_conversion == [a]
    gguf(a, b"same" + bytes([9]))  # same name, same size, new content
    assert load_model(str(a)).config.vocab_size == 309 and len(fake_conversion) == 2


def test_a_conversion_cut_short_is_not_taken_for_a_finished_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path / "cache"))
    a = gguf(tmp_path / "model.gguf", b"x" + bytes([4]))

    def interrupted(src_dir, gguf_file, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"half")
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr("minikv.model.gguf.convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve(str(a))
    monkeypatch.setattr("minikv.model.gguf.convert_gguf", lambda src, name, out: write_checkpoint(out, vocab_size=304))
    assert load_model(str(a)).config.vocab_size == 304


@pytest.mark.parametrize("content, message", [
    (os.urandom(1 << 20), r"model.gguf is not a GGUF file: it starts with .*, a GGUF file with b'GGUF'"),
    (b"", r"model.gguf is empty \(0 bytes\), not a GGUF model"),
    (b"GGU", r"model.gguf is not a GGUF file"),
])
def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path, fake_conversion, content, message):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        load_model(str(bad))
    assert str(bad) in str(e.value) and fake_conversion == []


# ---- checkpoint directories (item 10) ---------------------------------------------------------------

def test_corrupt_config_json_names_the_file(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"model_type": "llama", "vocab_size": 512,')
    with pytest.raises(ValueError, match="config.json is not valid JSON") as e:
        load_model(str(ckpt))
    assert str(ckpt / "config.json") in str(e.value)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object"):
        load_model(str(ckpt))


def test_config_missing_a_field_names_the_field_and_the_file(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_attention_heads"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json is missing 'num_attention_heads'") as e:
        load_model(str(ckpt))
    assert str(ckpt / "config.json") in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", "2", "num_hidden_layers must be a positive integer, got '2'"),
    ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_config_with_a_bad_size_names_it(tmp_path, field, value, message):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        load_model(str(ckpt))


def test_truncated_safetensors_names_the_file(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError,
                       match="could not read the weights in .*model.safetensors.*truncated or corrupt") as e:
        load_model(str(ckpt))
    assert str(weights) in str(e.value)


@pytest.mark.parametrize("missing", ["/no/such/dir", "./no-such-dir", "~/no-such-minikv-model", "no-such.gguf",
                                     "a/b/c"])
def test_missing_model_path_is_file_not_found_naming_it(missing):
    with pytest.raises(FileNotFoundError, match="model path .* does not exist") as e:
        load_model(missing)
    assert str(Path(missing).expanduser()) in str(e.value)


def test_a_weights_file_given_for_the_directory_says_to_pass_the_directory(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        load_model(str(ckpt / "model.safetensors"))


def test_model_that_is_not_a_name_or_path():
    with pytest.raises(ValueError, match="model must be a name"):
        load_model(42)


def test_a_path_object_loads_like_its_string(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    assert load_model(ckpt).config.vocab_size == 512


# ---- dtype ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, want", [
    ("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16), ("torch.float16", torch.float16),
    ("half", torch.float16), ("BFloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
])
def test_dtype_names(given, want):
    assert parse_dtype(given) is want


def test_dtype_default_follows_the_device():
    assert parse_dtype(None) is None
    assert parse_dtype(None, "cpu") is torch.float32 and parse_dtype("auto", torch.device("cpu")) is torch.float32
    assert parse_dtype(None, "cuda") is torch.bfloat16


@pytest.mark.parametrize("bad", ["float8", "int8", torch.float64, torch.int32, 16, True])
def test_unsupported_dtype_lists_the_accepted_ones(bad):
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16 .* got"):
        parse_dtype(bad)


def test_load_model_takes_a_dtype_name_and_refuses_float8():
    assert load_model("tiny-random", dtype="bf16").model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of .* got 'float8'"):
        load_model("tiny-random", dtype="float8")

