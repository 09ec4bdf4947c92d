"""What goes wrong around the engine, not inside a step: weights changed in place under a disk tier,
a writer killed mid-write, two engines on one directory, the directory deleted under a running
engine, close() with work queued, and every mistake a user can make on the command line."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.cache.tiers.block_file import file_bytes

BS = 4
POOL = dict(kv_backend="paged", block_size=BS, num_blocks=64, max_num_seqs=3, prefix_caching="hash")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [(7 * j) % 500 + 1 for j in range(113)]}  # 28 full blocks, 112 tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


def prompt_of(i: int) -> dict:
    return {"prompt_token_ids": [(31 * i + 7 * j) % 500 + 1 for j in range(4 * BS + 1)]}


def dir_bytes(root: Path) -> int:
    """Every byte the store holds under root: block files and temporary files, of every identity."""
    return sum(f.stat().st_size for f in root.glob("*/*") if f.is_file())


# ---- weights changed in place ---------------------------------------------------------------------
def _add_one(model):
    with torch.no_grad():
        next(model.parameters()).add_(1)


def _through_data(model):
    next(model.parameters()).data.mul_(1.5)  # .data bypasses the version counter: the sampled bytes see it


def _load_state_dict(model):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"].flip(0)
    model.load_state_dict(state)


@pytest.mark.parametrize("change", [_add_one, _through_data, _load_state_dict],
                         ids=["add_-under-no_grad", "through-.data", "load_state_dict"])
def test_an_engine_derived_after_an_in_place_weight_change_never_loads_the_old_blocks(tmp_path, change):
    llm = LLM("tiny-random", **POOL, kv_offload_dir=str(tmp_path))
    llm.generate(PROMPT, GREEDY)
    llm.close()
    with llm.derive() as same:  # unchanged weights: the disk hit the test must rule out afterwards
        same.generate(PROMPT, GREEDY)
        assert same.stats()["prefix_cache"]["hits_by_tier"].get("disk", 0) == 112
    change(llm.model)
    with llm.derive() as after:
        got = after.generate(PROMPT, GREEDY)[0].token_ids
        pc = after.stats()["prefix_cache"]
    assert pc["hits_by_tier"].get("disk", 0) == 0 and pc["offload"]["blocks_in"] == 0, pc["hits_by_tier"]
    assert got == LLM(llm.loaded, **POOL).generate(PROMPT, GREEDY)[0].token_ids  # a fresh engine, new weights


# ---- the disk directory ---------------------------------------------------------------------------
def test_temporary_files_of_a_writer_killed_mid_write_are_removed_at_open_and_live_ones_count(tmp_path):
    llm = LLM("tiny-random", **POOL, kv_offload_dir=str(tmp_path))
    block = llm.backend.pool.block_bytes
    folder = llm.offload_store.disk.dir
    llm.close()
    budget = 8 * file_bytes(block)
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)  # alive
    dead = [folder / f"{i:064x}.kv.{writer.pid}.140.tmp" for i in range(3)]  # its writes in progress
    for f in dead:
        f.write_bytes(b"x" * budget)
    writer.kill()  # kill -9 mid-write
    writer.wait()
    old = folder / f"{9:064x}.kv.{os.getpid()}.7.tmp"  # a live pid (reused?), but hours old
    old.write_bytes(b"x" * budget)
    os.utime(old, (1, 1))
    live = folder / f"{8:064x}.kv.{os.getpid()}.8.tmp"  # a write in progress right now: stays, counts
    live.write_bytes(b"x" * (2 * file_bytes(block)))
    with llm.derive(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=budget) as again:
        assert not any(f.exists() for f in dead + [old]) and live.exists()
        for i in range(4):
            again.generate(prompt_of(i), GREEDY)
        disk = again.stats()["prefix_cache"]["offload"]["tiers"]["disk"]
    assert disk["stale_tmp_removed"] == 4 and disk["evicted"] > 0
    assert dir_bytes(tmp_path) <= budget  # the live temporary file counted against the budget


def test_two_engines_on_one_directory_keep_to_one_budget(tmp_path):
    base = LLM("tiny-random", **POOL)
    budget = 10 * file_bytes(base.backend.pool.block_bytes)
    a = base.derive(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=budget)
    b = base.derive(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=budget)
    for i in range(4):  # each writes 4 blocks a prompt, other prompts than the other's: 32 blocks in all
        a.generate(prompt_of(i), GREEDY)
        b.generate(prompt_of(100 + i), GREEDY)
    a.close()
    b.close()
    written = sum(e.offload_store.disk.bytes_written for e in (a, b))
    assert written > 2 * budget, "the engines must write more than twice the budget, or the test proves nothing"
    assert dir_bytes(tmp_path) <= budget
    with base.derive(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=budget) as c:
        c.generate(prompt_of(103), GREEDY)  # the most recent blocks survived and are found
        assert c.stats()["prefix_cache"]["hits_by_tier"].get("disk", 0) == 4 * BS


def test_a_disk_directory_deleted_under_a_running_engine_is_created_again(tmp_path):
    root = tmp_path / "kv"
    with LLM("tiny-random", **POOL, kv_offload_dir=str(root)) as llm:
        llm.generate(prompt_of(0), GREEDY)
        llm.offload_store.flush()
        shutil.rmtree(root)
        disk = llm.stats()["prefix_cache"]["offload"]["tiers"]["disk"]
        assert disk["blocks"] == 0 and disk["bytes"] == 0  # the files are gone: stats() says so
        llm.generate(prompt_of(1), GREEDY)
        llm.offload_store.flush()
        disk = llm.stats()["prefix_cache"]["offload"]["tiers"]["disk"]
    assert disk["recreated"] == 1 and disk["failed_writes"] == 0
    assert disk["blocks"] == len(list(root.glob("*/*.kv"))) >= 4  # the prompt's blocks (and the answer's)
    with LLM("tiny-random", **POOL, kv_offload_dir=str(root)) as again:  # and a later engine finds them
        again.generate(prompt_of(1), GREEDY)
        assert again.stats()["prefix_cache"]["hits_by_tier"].get("disk", 0) == 4 * BS


def test_writes_that_cannot_be_made_are_counted_and_reported_once(tmp_path, capfd):
    root = tmp_path / "kv"
    with LLM("tiny-random", **POOL, kv_offload_dir=str(root)) as llm:
        shutil.rmtree(root)
        root.write_text("a file where the directory was")  # it cannot be created again
        want = LLM(llm.loaded, **POOL).generate([prompt_of(i) for i in range(2)], GREEDY)
        got = llm.generate([prompt_of(i) for i in range(2)], GREEDY)
        llm.offload_store.flush()
        offload = llm.stats()["prefix_cache"]["offload"]
        disk = offload["tiers"]["disk"]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]  # the engine serves on
    assert disk["failed_writes"] == offload["blocks_out"] > 0 and disk["writes"] == 0
    assert "NotADirectoryError" in disk["error"]
    lines = [line for line in capfd.readouterr().err.splitlines() if "KV disk tier" in line]
    assert len(lines) == 1 and "cannot write" in lines[0], lines


# ---- close() with work queued ---------------------------------------------------------------------
def test_close_aborts_what_is_queued_and_the_engine_then_says_it_is_closed(tmp_path):
    llm = LLM("tiny-random", **POOL, kv_offload_dir=str(tmp_path))
    queued = llm.add_request(prompt_of(0), GREEDY)
    events = llm.stream(prompt_of(1), SamplingParams(max_tokens=50, ignore_eos=True))
    first = next(events)
    llm.close()
    rest = list(events)
    assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert queued.finish_reason == "abort" and not llm.has_unfinished()
    for _ in range(2):  # the same clear error every time, never a failure loop
        with pytest.raises(RuntimeError, match="the engine is closed .* build a new LLM"):
            llm.step()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate(prompt_of(2), GREEDY)
    llm.close()  # idempotent


# ---- the command line -----------------------------------------------------------------------------
def minikv(tmp_path: Path, *args: str, cache: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIKV_CACHE": cache or str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minikv.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)


def assert_one_error_line(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "; " in lines[0], out.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


def tiny_gguf(path: Path) -> Path:
    """A small valid GGUF file (one layer's worth of metadata, two tensors)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(13)])
    w.add_token_scores([0.0] * 16)
    w.add_token_types([2, 3, 3] + [1] * 13)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).random((16, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model, words", [
    ("missing", ("does not exist",)),
    ("missing.gguf", ("does not exist",)),
    ("here/missing", ("does not exist",)),  # "org/name" would be a hub id, but ./here is a local folder
])
def test_cli_a_model_path_that_does_not_exist_is_one_error_line_never_a_download(tmp_path, model, words):
    (tmp_path / "here").mkdir()
    assert_one_error_line(minikv(tmp_path, "generate", "--model", str(tmp_path / model) if model == "missing"
                                 else model, "--prompt", "hi"), *words)


def test_cli_a_checkpoint_directory_without_weights_is_one_error_line(tmp_path):
    from minikv.model.named import TINY_RANDOM_CONFIG

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_RANDOM_CONFIG))
    assert_one_error_line(minikv(tmp_path, "generate", "--model", str(ckpt), "--prompt", "hi"),
                          "no *.safetensors", "put the checkpoint's weight files")
    (ckpt / "config.json").unlink()
    assert_one_error_line(minikv(tmp_path, "generate", "--model", str(ckpt), "--prompt", "hi"), "no config.json")


@pytest.mark.parametrize("cut", [700, 1400], ids=["in-the-metadata", "in-the-tensors"])
def test_cli_a_truncated_gguf_says_which_file_and_what_to_do(tmp_path, cut):
    data = tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    assert len(data) > cut
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    out = minikv(tmp_path, "generate", "--model", str(tmp_path / "cut.gguf"), "--prompt", "hi")
    assert_one_error_line(out, "cut.gguf", "truncated", "download or copy it again")
    assert not list((tmp_path / "cache" / "gguf").glob("*.partial")), "a failed conversion left its folder"


@pytest.mark.parametrize("model", ["smollm2-135m", "model.gguf"])
def test_cli_minikv_cache_pointing_at_a_file_is_one_error_line(tmp_path, model):
    (tmp_path / "not-a-dir").write_text("x")
    tiny_gguf(tmp_path / "model.gguf")
    out = minikv(tmp_path, "generate", "--model", model, "--prompt", "hi", cache=str(tmp_path / "not-a-dir"))
    assert_one_error_line(out, "MINIKV_CACHE=", "is a file, not a directory", "point MINIKV_CACHE at a directory")


@pytest.mark.slow  # over 6 s on a 2-core machine: make test runs it, make test-fast leaves it out
def test_cli_serve_on_a_port_out_of_range_or_taken_or_a_missing_model_is_one_error_line(tmp_path):
    assert_one_error_line(minikv(tmp_path, "serve", "--model", "tiny-random", "--port", "99999"),
                          "--port must be in 0..65535, got 99999")
    assert_one_error_line(minikv(tmp_path, "serve", "--model", str(tmp_path / "missing"), "--port", "0"),
                          "does not exist")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_error_line(minikv(tmp_path, "serve", "--model", "tiny-random", "--port", str(port)),
                              f"cannot listen on 127.0.0.1:{port}", "pick another --port")
