"""Offline throughput: minikv's paged engine against transformers, same process, same device, same requests.

    python -m minikv.bench.throughput --out benchmarks/throughput_gpu.json     (GPU, the recorded run)
    python -m minikv.bench.throughput --shape llama-3.1-8b --out ...            (the 8B model's shapes)
    python -m minikv.bench.throughput --small                                   (CPU smoke test, ~1 min)

The workload is nano-vllm's: random.seed(0), 256 requests, prompt and output lengths uniform in
[100, 1024], prompt ids uniform in [0, 10000], EOS ignored (133,966 output tokens), on a model with
Qwen2.5-0.5B's shapes (or Llama-3.1-8B's) and random bf16 weights (speed does not depend on what the
weights say). Each run is greedy and sampled (temperature 0.6, top-p 0.95: nano-vllm's own
benchmark samples), `--sampling` picks:

    1. correctness first: minikv's greedy tokens against transformers' `generate` on a few short
       requests, in float32 (must be equal) and in the benchmark dtype (a small mismatch rate is
       expected: two implementations round differently, and one flipped argmax changes the rest)
    2. minikv paged with Triton attention, tuned (max_num_seqs=256, max_num_batched_tokens=16384) and
       with the defaults `LLM(ckpt)` picks for the device; optionally the torch reference (`torch`) and
       Triton with eager decode steps (`triton_eager`); graph tokens first checked against eager ones
    3. transformers continuous batching (`ContinuousBatchingManager`, what `generate_batch` drives;
       used directly because it takes a max_new_tokens per request), greedy and sampled alike
    4. transformers padded `generate` on the first requests of the workload (one padded batch:
       every row runs until the longest output is done; useful tokens are counted)

`ratios` in the record: sampled over greedy, defaults over tuned, minikv over transformers, each from
this run. On a GPU `limits` holds the measured copy bandwidth and matmul rate, and the floor they
put under the tuned run: every step reads the weights once and every decode token reads its
context's K and V once (bytes over copy bandwidth), plus the prefill's FLOPs over the matmul rate.

Every engine gets a time cap; a run that hits it reports the tokens it made so far and says so.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minikv.bench import environment, first_divergence

QWEN25_05B_SHAPE = {  # Qwen2.5-0.5B's config.json, weights aside
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "use_sliding_window": False, "bos_token_id": 151643,
    "eos_token_id": 151643}
LLAMA31_8B_SHAPE = {  # Llama-3.1-8B's config.json, weights aside
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128001}
# --small: the same architecture, narrow and shallow, so a CPU runs the whole script in about a minute
SMALL_SHAPE = dict(QWEN25_05B_SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=10240)


def workload(num_requests: int = 256, min_len: int = 100, max_len: int = 1024, max_id: int = 10000,
             seed: int = 0) -> list[tuple[list[int], int]]:
    """[(prompt ids, output length)], drawn in nano-vllm's order: all prompts first, then all lengths."""
    random.seed(seed)
    prompts = [[random.randint(0, max_id) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_requests)]
    outputs = [random.randint(min_len, max_len) for _ in range(num_requests)]
    return list(zip(prompts, outputs))


def random_init_(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Seeded random weights, wide enough for decisive argmaxes (Hugging Face parameter names): norms 1,
    biases N(0, 0.1), embeddings N(0, 1), every matrix N(0, 1 / fan_in)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=generator)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=generator)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5, generator=generator)


def make_random_checkpoint(shape: dict, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                           device: str = "cpu") -> Path:
    """A transformers checkpoint (config.json + safetensors, no tokenizer) with seeded random weights.

    Weights are drawn wider than transformers' default init (std 0.02 makes every logit nearly equal,
    so greedy decoding would hinge on rounding noise): the correctness check needs decisive argmaxes.
    An 8B model is drawn on the GPU in bf16 (`device`, `dtype`): on a CPU in float32 it takes minutes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    random_init_(model, torch.Generator(device).manual_seed(seed))
    model.save_pretrained(path)
    return path


def load_hf(path: Path, device: str, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Give freed GPU memory back, so the next engine sizes its KV pool from what is really free."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ---- 1. correctness ---------------------------------------------------------------------------
def check_tokens(ckpt: Path, device: str, dtype: torch.dtype, attention: str = "torch", num_requests: int = 4,
                 max_tokens: int = 24, hf_model=None) -> dict:
    """Greedy tokens of minikv (paged) and transformers on the same short prompts.

    `token_match` counts positions equal up to each request's first divergence (after it, the two
    continue from different text and a comparison means nothing)."""
    from transformers import GenerationConfig

    from minikv import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(8, 64))] for _ in range(num_requests)]
    llm = LLM(str(ckpt), device=device, dtype=dtype, kv_backend="paged", attention=attention, num_blocks=256,
              max_model_len=512)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    graphs = llm.engine_config.cuda_graphs  # on by default with Triton attention on a GPU
    del llm
    release(device)
    hf = hf_model if hf_model is not None else load_hf(ckpt, device, dtype)
    cfg = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    theirs = []
    with torch.no_grad():
        for p in prompts:  # one at a time: no padding, so transformers runs its plainest path
            out = hf.generate(torch.tensor([p], device=device), generation_config=cfg)
            theirs.append(out[0, len(p):].tolist())
    if hf_model is None:
        del hf
        release(device)
    matched = [min(len(a), len(b)) if (n := first_divergence(a, b)) is None else n for a, b in zip(ours, theirs)]
    return {"dtype": str(dtype).replace("torch.", ""), "attention": attention, "cuda_graphs": graphs,
            "num_requests": num_requests,
            "max_tokens": max_tokens, "requests_identical": sum(a == b for a, b in zip(ours, theirs)),
            "tokens_before_first_divergence": matched,
            "token_match": sum(matched) / (num_requests * max_tokens)}


def check_graph_tokens(ckpt: Path, device: str, num_requests: int = 6) -> dict:
    """Greedy float32 tokens of the Triton engine with decode steps replayed from CUDA graphs and
    launched eagerly: the batch shrinks as requests finish, so several buckets and padding rows run."""
    from minikv import LLM, SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(8, 64))] for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=8 + 5 * i, ignore_eos=True) for i in range(num_requests)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(ckpt), device=device, dtype=torch.float32, kv_backend="paged", attention="triton",
                  num_blocks=256, max_model_len=512, max_num_seqs=8, cuda_graphs=graphs)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        release(device)
    return {"dtype": "float32", "attention": "triton", "check": "cuda graphs vs eager decode",
            "num_requests": num_requests, "requests_identical": sum(a == b for a, b in zip(outs[True], outs[False]))}


# ---- 2. minikv ---------------------------------------------------------------------------------
SAMPLING = {"greedy": {}, "sampled": {"temperature": 0.6, "top_p": 0.95}}  # SamplingParams beside max_tokens
TUNED = {"max_num_seqs": 256, "max_num_batched_tokens": 16384}


def run_minikv(ckpt: Path, requests, device: str, dtype: torch.dtype, attention: str = "torch",
               cap_s: float = 1e9, max_num_seqs: int | None = 256, max_num_batched_tokens: int | None = 16384,
               block_size: int = 16, cuda_graphs: bool | None = None, sampling: str = "greedy",
               defaults: bool = False) -> dict:
    """One engine over the workload. defaults=True: `LLM(ckpt)` with only the device and dtype given
    (what a user who tunes nothing gets; on a CPU a paged pool with the CPU's sizes)."""
    from minikv import LLM, SamplingParams

    t_start = time.perf_counter()
    if defaults:
        llm = LLM(str(ckpt), device=device, dtype=dtype, **({} if device.startswith("cuda") else
                                                            {"kv_backend": "paged", "attention": attention}))
    else:
        llm = LLM(str(ckpt), device=device, dtype=dtype, kv_backend="paged", attention=attention,
                  block_size=block_size, max_model_len=2048, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, cuda_graphs=cuda_graphs)
    startup = time.perf_counter() - t_start  # with CUDA graphs: every batch bucket captured
    # warm up: one short request through prefill and decode (allocator, kernels, autotuning)
    llm.generate([list(range(1, 65))], SamplingParams(max_tokens=8, ignore_eos=True, **SAMPLING[sampling]))
    seqs = [llm.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **SAMPLING[sampling]))
            for i, (p, n) in enumerate(requests)]
    sync(device)
    t0 = time.perf_counter()
    steps = 0
    while llm.has_unfinished() and time.perf_counter() - t0 < cap_s:
        llm.step()
        steps += 1
    sync(device)
    elapsed = time.perf_counter() - t0
    made = sum(len(s.output_token_ids) for s in seqs)
    target = sum(n for _, n in requests)
    stats = llm.stats()
    cfg = stats["config"]
    out = {"engine": "minikv", "attention": llm.attention, "cuda_graphs": llm.engine_config.cuda_graphs,
           "sampling": sampling, "config": "defaults" if defaults else "tuned", "chosen": cfg["chosen"],
           "startup_s": round(startup, 2), "block_size": llm.block_size, "max_num_seqs": cfg["max_num_seqs"],
           "max_num_batched_tokens": cfg["max_num_batched_tokens"], "num_blocks": stats["num_blocks"],
           "num_preemptions": stats["num_preemptions"], "steps": steps, "seconds": elapsed,
           "output_tokens": made, "tokens_per_s": made / elapsed, "complete": made == target}
    if made != target:
        out["note"] = f"stopped at the {cap_s:.0f} s cap after {made:,} of {target:,} output tokens"
    for s in seqs:
        if not s.is_finished:
            llm.abort(s)
    del llm, seqs
    release(device)
    return out


# ---- 3. transformers continuous batching -------------------------------------------------------
def run_hf_continuous(model, requests, cap_s: float = 1e9, sampling: str = "greedy") -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    how = {"do_sample": False} if sampling == "greedy" else {"do_sample": True, "top_k": 0, **SAMPLING[sampling]}
    cfg = GenerationConfig(eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in requests), **how)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in requests),
                          max_generated_length=max(n for _, n in requests), num_requests=len(requests))
    tokens: dict[str, int] = {}
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=10,
                                                   workload_hints=hints) as manager:
        attn = model.config._attn_implementation  # as the manager left it (it may switch to a paged one)
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(requests):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(tokens) < len(requests) and time.perf_counter() - t0 < cap_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                tokens[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        elapsed = time.perf_counter() - t0
        if len(tokens) < len(requests):
            manager.stop(block=True, timeout=10, hard_stop=True)
    made = sum(tokens.values())
    target = sum(n for _, n in requests)
    out = {"engine": "transformers continuous batching", "attn_implementation": attn, "sampling": sampling,
           "seconds": elapsed,
           "output_tokens": made, "tokens_per_s": made / elapsed, "complete": len(tokens) == len(requests)}
    if len(tokens) < len(requests):
        out["note"] = (f"stopped at the {cap_s:.0f} s cap with {len(tokens)} of {len(requests)} requests finished "
                       f"({made:,} of {target:,} output tokens counted, finished requests only)")
    return out


# ---- 4. transformers padded generate -----------------------------------------------------------
def run_hf_padded(model, requests, device: str) -> dict:
    """One left-padded batch: the classic `generate` (static batching, rung 3's baseline)."""
    from transformers import GenerationConfig

    longest_prompt, longest_out = max(len(p) for p, _ in requests), max(n for _, n in requests)
    ids = torch.zeros(len(requests), longest_prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(requests):
        ids[i, longest_prompt - len(p):] = torch.tensor(p)
        mask[i, longest_prompt - len(p):] = 1
    cfg = GenerationConfig(max_new_tokens=longest_out, min_new_tokens=longest_out, do_sample=False, pad_token_id=0)
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        model.generate(ids[:, -16:], attention_mask=mask[:, -16:], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, pad_token_id=0))  # warm up
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, generation_config=cfg)
        sync(device)
    elapsed = time.perf_counter() - t0
    useful = sum(n for _, n in requests)
    return {"engine": "transformers padded generate", "attn_implementation": model.config._attn_implementation,
            "num_requests": len(requests), "seconds": elapsed, "output_tokens": useful,
            "tokens_per_s": useful / elapsed, "padded_tokens_per_s": len(requests) * longest_out / elapsed,
            "note": f"one batch of the first {len(requests)} requests; every row decodes {longest_out} tokens, "
                    "only each request's own output length is counted"}


# ---- the physical floor ------------------------------------------------------------------------
def measure_limits(device: str) -> dict:
    """The card's measured ceilings: copy bandwidth (bytes read + written by a 1 GiB device copy) and
    a bf16 matrix product's rate, medians of CUDA-event timings."""
    a = torch.empty(2**29, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def median_ms(fn, n=20) -> float:
        fn()
        times = []
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[n // 2]

    copy_ms = median_ms(lambda: b.copy_(a))  # noqa: F821 (the closures run before the `del` below)
    mm_ms = median_ms(lambda: m @ m)  # noqa: F821
    out = {"copy_bytes_per_s": 2 * a.numel() * 2 / (copy_ms / 1e3), "bf16_flops_per_s": 2 * 8192**3 / (mm_ms / 1e3)}
    del a, b, m
    release(device)
    return out


def floor_seconds(shape: dict, requests, steps: int, limits: dict, dtype_bytes: int = 2) -> dict:
    """The least time the workload can take on this card, given the engine's number of steps: each step
    reads the weights once; each decode token reads K and V of its whole context once; the prefill's
    matrix products run at the measured matmul rate."""
    h, inter, layers, vocab = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "vocab_size"))
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * inter
    params = layers * per_layer + vocab * h * (1 if shape["tie_word_embeddings"] else 2)
    kv_per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    kv_reads = sum(kv_per_token * (len(p) * n + n * (n + 1) // 2) for p, n in requests)  # context at each token
    weights = steps * params * dtype_bytes
    prefill_flops = sum(2 * len(p) * layers * per_layer for p, _ in requests)
    memory_s = (weights + kv_reads) / limits["copy_bytes_per_s"]
    compute_s = prefill_flops / limits["bf16_flops_per_s"]
    return {"params": params, "weight_bytes_per_step": params * dtype_bytes, "steps": steps,
            "kv_bytes_read": kv_reads, "memory_s": memory_s, "prefill_compute_s": compute_s,
            "floor_s": memory_s + compute_s}


# ---- the record --------------------------------------------------------------------------------
SHAPES = {"qwen2.5-0.5b": QWEN25_05B_SHAPE, "llama-3.1-8b": LLAMA31_8B_SHAPE, "small": SMALL_SHAPE}


def ratios(results: list[dict], attention: str) -> dict:
    """sampled / greedy, defaults / tuned and minikv / transformers, from the runs of this record (minikv:
    its runs with `attention`, decode steps as the engine runs them by default; medians over repeats)."""
    def tps(engine: str, sampling: str, config: str | None = None) -> float | None:
        """The median over repeats (--repeats) of this run's tokens per second."""
        runs = [r["tokens_per_s"] for r in results if r["engine"] == engine and r.get("sampling") == sampling
                and (engine != "minikv" or (r["config"] == config and r["attention"] == attention
                                            and r["cuda_graphs"] == (attention == "triton")))]
        return statistics.median(runs) if runs else None

    out: dict = {}
    for name, (a, b) in {
        "sampled_over_greedy_tuned": (tps("minikv", "sampled", "tuned"), tps("minikv", "greedy", "tuned")),
        "sampled_over_greedy_defaults": (tps("minikv", "sampled", "defaults"), tps("minikv", "greedy", "defaults")),
        "defaults_over_tuned_greedy": (tps("minikv", "greedy", "defaults"), tps("minikv", "greedy", "tuned")),
        "defaults_over_tuned_sampled": (tps("minikv", "sampled", "defaults"), tps("minikv", "sampled", "tuned")),
        "minikv_tuned_over_transformers_greedy": (tps("minikv", "greedy", "tuned"),
                                                  tps("transformers continuous batching", "greedy")),
        "minikv_tuned_over_transformers_sampled": (tps("minikv", "sampled", "tuned"),
                                                   tps("transformers continuous batching", "sampled")),
    }.items():
        if a is not None and b:
            out[name] = round(a / b, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model and workload: a CPU smoke test (--shape small)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shapes (default qwen2.5-0.5b)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=None, help="first N requests of the workload (default all)")
    ap.add_argument("--sampling", default="greedy,sampled",
                    help="comma list: greedy (argmax), sampled (T=0.6, top-p 0.95)")
    ap.add_argument("--padded-requests", type=int, default=32, help="requests in the padded-generate batch")
    ap.add_argument("--cap", type=float, default=170.0, help="seconds each minikv engine may run")
    ap.add_argument("--hf-cap", type=float, default=None, help="seconds transformers may run (default --cap)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each minikv tuned and defaults engine, greedy and sampled taking turns "
                         "(the ratios take medians); the other engines run once")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--skip", default="torch,triton_eager,hf_padded",
                    help="comma list of phases to skip: checks,torch,triton,triton_eager,defaults,hf_cb,hf_padded")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (runs of each minikv engine), got {args.repeats}")
    skip = set(filter(None, args.skip.split(",")))
    modes = [m for m in args.sampling.split(",") if m]
    if not modes or any(m not in SAMPLING for m in modes):
        ap.error(f"--sampling takes a comma list of {', '.join(SAMPLING)}, got {args.sampling!r}")
    shape_name = "small" if args.small else (args.shape or "qwen2.5-0.5b")
    shape = SHAPES[shape_name]
    dev = args.device
    if shape_name == "small":
        requests = workload(num_requests=args.num_requests or 8, min_len=8, max_len=48, max_id=shape["vocab_size"] - 1)
        dtype = torch.float32
    else:
        requests = workload()[: args.num_requests]
        dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    big = shape_name == "llama-3.1-8b"
    record = {"benchmark": "offline throughput (nano-vllm workload)", **environment(dev, args.commit),
              "model": {"qwen2.5-0.5b": "Qwen2.5-0.5B shapes, random weights", "small": "small qwen2 (smoke test)",
                        "llama-3.1-8b": "Llama-3.1-8B shapes, random weights"}[shape_name],
              "dtype": str(dtype).replace("torch.", ""), "sampling": {m: SAMPLING[m] for m in modes},
              "tuned": TUNED, "repeats": args.repeats,
              "workload": {"seed": 0, "num_requests": len(requests), "prompt_tokens": sum(len(p) for p, _ in requests),
                           "output_tokens": sum(n for _, n in requests), "ignore_eos": True},
              "checks": [], "results": [], "errors": []}

    def save() -> None:
        record["results"][:] = [r for r in record["results"] if r is not None]  # in place: a phase appends to it
        record["checks"][:] = [c for c in record["checks"] if c is not None]
        record["ratios"] = ratios(record["results"], "triton" if triton_ok else "torch")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

    def phase(name: str, fn, into: str | None = None):
        """Run one phase; its result goes into record[into] (if given) and is saved at once."""
        t = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # a broken phase is reported, the others still run
            record["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:500]}")
            print(f"[bench] {name} failed: {type(e).__name__}: {e}", flush=True)
            result = None
        print(f"[bench] {name}: {time.perf_counter() - t:.1f} s  {json.dumps(result)[:400]}", flush=True)
        if into is not None:
            record[into].append(result)
        save()
        return result

    hf_cap = args.hf_cap if args.hf_cap is not None else args.cap
    triton_ok = dev.startswith("cuda") and "triton" not in skip
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_random_checkpoint(shape, Path(tmp) / "model", dtype=torch.bfloat16 if big else torch.float32,
                                      device=dev if big else "cpu")
        release(dev)
        if dev.startswith("cuda"):
            record["limits"] = phase("limits", lambda: measure_limits(dev))
        if "checks" not in skip and not big:
            phase("check float32", lambda: check_tokens(ckpt, dev, torch.float32), into="checks")
            if dtype != torch.float32:
                phase(f"check {dtype}", lambda: check_tokens(ckpt, dev, dtype), into="checks")
            if triton_ok:
                hf = load_hf(ckpt, dev, dtype)
                tri = phase("check triton", lambda: check_tokens(ckpt, dev, dtype, attention="triton", hf_model=hf),
                            into="checks")
                del hf
                release(dev)
                triton_ok = tri is not None  # its match rate is in the record, next to the torch one
                phase("check cuda graphs", lambda: check_graph_tokens(ckpt, dev), into="checks")
        attention = "triton" if triton_ok else "torch"
        for rep in range(args.repeats):  # the engines of each mode take turns: drift hits both modes alike
            once = rep == 0
            for mode in modes:
                label = f", {mode}" + (f" (repeat {rep + 1})" if args.repeats > 1 else "")
                if once and "torch" not in skip and attention == "triton":
                    phase(f"minikv torch{label}", lambda: run_minikv(
                        ckpt, requests, dev, dtype, cap_s=args.cap, sampling=mode), into="results")
                if "triton" not in skip or attention == "torch":
                    phase(f"minikv {attention} tuned{label}", lambda: run_minikv(
                        ckpt, requests, dev, dtype, attention, cap_s=args.cap, sampling=mode, **TUNED), into="results")
                if "defaults" not in skip:
                    phase(f"minikv defaults{label}", lambda: run_minikv(
                        ckpt, requests, dev, dtype, attention, cap_s=args.cap, sampling=mode, defaults=True),
                        into="results")
                if once and "triton_eager" not in skip and attention == "triton":
                    phase(f"minikv triton, eager decode{label}", lambda: run_minikv(
                        ckpt, requests, dev, dtype, "triton", cap_s=args.cap, cuda_graphs=False, sampling=mode),
                        into="results")
                if once and "hf_cb" not in skip:
                    hf = load_hf(ckpt, dev, dtype)
                    phase(f"transformers continuous batching{label}",
                          lambda: run_hf_continuous(hf, requests, cap_s=hf_cap, sampling=mode), into="results")
                    del hf
                    release(dev)
        if "hf_padded" not in skip:
            hf = load_hf(ckpt, dev, dtype)  # a fresh model: continuous batching switched its attention
            phase("transformers padded generate",
                  lambda: run_hf_padded(hf, requests[: args.padded_requests], dev), into="results")
            del hf
            release(dev)
    tuned = next((r for r in record["results"] if r and r.get("config") == "tuned" and r["engine"] == "minikv"
                  and r["complete"]), None)
    if record.get("limits") and tuned is not None:
        floor = floor_seconds(shape, requests, tuned["steps"], record["limits"], dtype.itemsize)
        floor["tuned_seconds"] = tuned["seconds"]
        floor["tuned_over_floor"] = round(tuned["seconds"] / floor["floor_s"], 2)
        record["floor"] = floor
    save()
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
