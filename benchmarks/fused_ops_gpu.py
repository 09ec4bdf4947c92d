"""The fused decoder-layer kernels on a GPU: correct in bf16, and what they save per op and per step.

    python3 benchmarks/fused_ops_gpu.py --out DIR_OR_FILE.json      (a CUDA device; about 2 minutes)

1. correctness, bf16: fused_add_rms_norm, rotary_qkv and silu_and_mul against the torch ops they
   replace (T = 1, 17, 256, 4096; Qwen2.5-0.5B's sizes), and the whole model's logits with fused_ops
   on and off, each against the same weights in float32 (the fused path may not be further from it
   than the torch path, give or take bf16 noise)
2. per op (CUDA events around a CUDA graph of 20 launches, median of 30 replays, so launch overhead
   is what a graph-replayed decode step pays): the fused kernel against the torch sequence it replaces,
   at T = 256 (a decode step) and 4,096 (a prefill chunk)
3. one decode step of the engine (Qwen2.5-0.5B shapes, random bf16 weights, --num-seqs sequences,
   paged + Triton attention + CUDA graphs), fused_ops off then on, same weights, same requests: the
   device time of the step's graph replay (events, median) and the host-side step time (median)
Prints a table and writes the figures as JSON (--out: a .json path, or a directory for fused_ops_gpu.json).
Exits with status 1 when a correctness check fails (the timings are still written).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import minikv.kernels  # noqa: F401, I001  (first: on a CPU it switches Triton to its interpreter)
from minikv import LLM, SamplingParams
from minikv.attention.metadata import AttentionMetadata
from minikv.attention.naive import NaiveBackend
from minikv.bench import environment, first_divergence
from minikv.bench.throughput import QWEN25_05B_SHAPE, random_init_
from minikv.kernels import fused_add_rms_norm, rotary_qkv, silu_and_mul
from minikv.model.config import ModelConfig
from minikv.model.llama import LlamaForCausalLM, RMSNorm, apply_rope, rope_inv_freq
from minikv.model.loader import LoadedModel

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=1.6e-2)  # a few bf16 units in the last place (bf16 epsilon is 2^-8)


def random_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """Qwen2.5-0.5B's shapes with seeded random bf16 weights, wide enough for decisive argmaxes."""
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg)
    random_init_(model, torch.Generator(DEVICE).manual_seed(seed))
    return model.to(BF16).eval()


def graph_ms(fn, reps: int = 20, trials: int = 30) -> float:
    """Milliseconds per call of fn, replayed from a CUDA graph of `reps` calls: median of `trials`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles the Triton kernels, sets up cuBLAS
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return replay_ms(graph) / reps


def replay_ms(graph: torch.cuda.CUDAGraph, trials: int = 30) -> float:
    graph.replay()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class OpCase:
    """One op at T tokens: the torch sequence the model runs unfused, and the fused kernel, on the same inputs.
    With dtype=float32 the same bf16 values, widened: its torch sequence is the exact answer to compare with."""

    def __init__(self, cfg: ModelConfig, T: int, seed: int = 0, dtype: torch.dtype = BF16):
        g = torch.Generator(DEVICE).manual_seed(seed)
        H, KV, D, hidden, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

        def r(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=g, device=DEVICE) * scale + shift).to(BF16).to(dtype)

        self.cfg, self.T = cfg, T
        self.x, self.residual = r(T, hidden), r(T, hidden)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps).to(DEVICE, dtype)
        self.norm.weight.data = r(hidden, scale=0.3, shift=1.0)
        self.qkv = r(T, (H + 2 * KV) * D, scale=2.0)
        self.q, self.k, self.v = (t.reshape(T, -1, D).contiguous() for t in self.qkv.split([H * D, KV * D, KV * D], -1))
        self.positions = torch.randint(0, 32768, (T,), generator=g, device=DEVICE)
        self.inv_freq = rope_inv_freq(cfg).to(DEVICE)
        angles = self.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = emb.cos().to(BF16), emb.sin().to(BF16)
        self.gate_up = r(T, 2 * inter, scale=2.0)
        self.gate, self.up = (t.contiguous() for t in self.gate_up.chunk(2, dim=-1))
        self.w_qkv, self.b_qkv = r((H + 2 * KV) * D, hidden, scale=hidden**-0.5), r((H + 2 * KV) * D, scale=0.1)
        self.w_gate_up = r(2 * inter, hidden, scale=hidden**-0.5)
        self.w_q, self.w_k, self.w_v = self.w_qkv.split([H * D, KV * D, KV * D])
        self.b_q, self.b_k, self.b_v = self.b_qkv.split([H * D, KV * D, KV * D])
        self.w_gate, self.w_up = self.w_gate_up.chunk(2)

    # (name, torch sequence, fused) -> both return comparable outputs
    def ops(self):
        c = self
        return {
            "add + rmsnorm": (lambda: (lambda s: (c.norm(s), s))(c.x + c.residual),
                              lambda: fused_add_rms_norm(c.x, c.residual, c.norm.weight, c.norm.eps)),
            "rotary q,k (+ split)": (lambda: (apply_rope(c.q, c.cos, c.sin), apply_rope(c.k, c.cos, c.sin), c.v),
                                     lambda: rotary_qkv(c.qkv, c.positions, c.inv_freq, c.cfg.num_heads,
                                                        c.cfg.num_kv_heads)),
            "silu_and_mul": (lambda: F.silu(c.gate) * c.up, lambda: silu_and_mul(c.gate_up)),
            "q,k,v projections": (lambda: (F.linear(c.x, c.w_q, c.b_q), F.linear(c.x, c.w_k, c.b_k),
                                           F.linear(c.x, c.w_v, c.b_v)),
                                  lambda: F.linear(c.x, c.w_qkv, c.b_qkv)),
            "gate,up projections": (lambda: (F.linear(c.x, c.w_gate), F.linear(c.x, c.w_up)),
                                    lambda: F.linear(c.x, c.w_gate_up)),
        }


def check_kernels(cfg: ModelConfig) -> list[dict]:
    """Each fused kernel and its torch sequence in bf16, both against the torch sequence in float32 on the
    same values: the kernel must be within bf16 tolerance of it, and no further from it than torch is
    (give or take one bf16 unit: the two round at different places)."""
    def as_tuple(out):
        return tuple(t.float() for t in (out if isinstance(out, tuple) else (out,)))

    def max_err(got, want):
        return max((g - w).abs().max().item() for g, w in zip(got, want))

    rows = []
    for T in (1, 17, 256, 4096):
        ops, exact_ops = OpCase(cfg, T, seed=T).ops(), OpCase(cfg, T, seed=T, dtype=torch.float32).ops()
        for name in ("add + rmsnorm", "rotary q,k (+ split)", "silu_and_mul"):
            (ref, fused), exact = ops[name], as_tuple(exact_ops[name][0]())
            got, torch_out = as_tuple(fused()), as_tuple(ref())
            err, torch_err = max_err(got, exact), max_err(torch_out, exact)
            unit = max(w.abs().max().item() for w in exact) * 2**-8  # one bf16 unit at the largest value
            ok = all(torch.allclose(g, w, **TOL) for g, w in zip(got, exact)) and err <= torch_err + unit
            rows.append({"op": name, "T": T, "max_abs_err_fused": err, "max_abs_err_torch": torch_err, "ok": ok})
    return rows


def check_model_logits(model: LlamaForCausalLM, cfg: ModelConfig) -> dict:
    """Logits of two ragged prompts, bf16 fused and unfused, each against the same weights in float32."""
    lens = [37, 200]
    ids = torch.randint(0, 10000, (sum(lens),), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    meta = AttentionMetadata.build(lens, lens, DEVICE)
    backend = NaiveBackend(cfg.sliding_window)
    reference = copy.deepcopy(model).float()
    with torch.inference_mode():
        exact = reference(ids, positions, meta, backend)
        del reference
        out = {}
        for fused in (False, True):
            model.fused_ops = fused
            out[fused] = model(ids, positions, meta, backend)
    model.fused_ops = False
    err = {f: ((out[f] - exact).abs().max() / exact.abs().max()).item() for f in out}
    agree = {f: (out[f].argmax(-1) == exact.argmax(-1)).float().mean().item() for f in out}
    return {"tokens": sum(lens), "rel_err_unfused": err[False], "rel_err_fused": err[True],
            "argmax_agree_unfused": agree[False], "argmax_agree_fused": agree[True],
            "fused_vs_unfused_rel": ((out[True] - out[False]).abs().max() / exact.abs().max()).item(),
            "ok": err[True] <= 1.5 * err[False] + 1e-2 and agree[True] >= agree[False] - 0.02}


def time_ops(cfg: ModelConfig) -> list[dict]:
    rows = []
    for T in (256, 4096):
        case = OpCase(cfg, T)
        for name, (ref, fused) in case.ops().items():
            torch_ms, fused_ms = graph_ms(ref), graph_ms(fused)
            rows.append({"op": name, "T": T, "torch_us": torch_ms * 1e3, "fused_us": fused_ms * 1e3,
                         "speedup": torch_ms / fused_ms})
    return rows


def time_engine_step(loaded: LoadedModel, fused: bool, args) -> dict:
    """Decode steps of --num-seqs sequences once every prompt is in: step wall time, graph replay time."""
    llm = LLM(loaded, device="cuda", dtype=BF16, max_num_seqs=args.num_seqs, max_model_len=args.max_model_len,
              kv_cache_memory=args.kv_cache_gib * 2**30, max_num_batched_tokens=16384, fused_ops=fused)
    assert llm.model.fused_ops is fused and llm.runner.decode_graphs is not None
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.skip + args.steps + 8, temperature=0.0, ignore_eos=True)
    seqs = [llm.add_request(torch.randint(0, 10000, (args.prompt_len,), generator=g).tolist(), params)
            for _ in range(args.num_seqs)]
    for _ in range(args.skip):  # every prompt prefilled, every sequence decoding
        llm.step()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    graphs = llm.runner.decode_graphs
    bucket = graphs.bucket(args.num_seqs)
    replay = replay_ms(graphs.graphs[bucket], trials=50)  # the last step again, on the buffers it left
    tokens = [s.token_ids[args.prompt_len:] for s in seqs]
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return {"fused_ops": fused, "step_ms_median": statistics.median(times), "graph_replay_ms_median": replay,
            "bucket": bucket, "tokens": tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".", help="a .json file, or a directory for fused_ops_gpu.json")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=int, default=6)
    ap.add_argument("--skip", type=int, default=12, help="steps before measuring (the prefills)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device; on a CPU, tests/test_fused_ops.py checks the kernels")
    cfg = ModelConfig.from_hf(QWEN25_05B_SHAPE, source="QWEN25_05B_SHAPE")
    record = {"env": environment("cuda"), "model": "Qwen2.5-0.5B shapes, random bf16 weights", "args": vars(args)}

    record["kernel_checks"] = check_kernels(cfg)
    model = random_model(cfg)
    record["model_logits"] = check_model_logits(model, cfg)
    record["ops"] = time_ops(cfg)
    loaded = LoadedModel(model, cfg, None, "random Qwen2.5-0.5B shapes")
    steps = [time_engine_step(loaded, fused, args) for fused in (False, True)]
    diverge = [first_divergence(a, b) for a, b in zip(steps[0]["tokens"], steps[1]["tokens"])]
    same = diverge.count(None)
    late = sorted(d for d in diverge if d is not None)
    for s in steps:
        del s["tokens"]
    speedup = steps[0]["graph_replay_ms_median"] / steps[1]["graph_replay_ms_median"]
    record["engine_step"] = {"unfused": steps[0], "fused": steps[1], "num_seqs": args.num_seqs,
                             "sequences_with_same_tokens": same,
                             "first_divergence_median": statistics.median(late) if late else None,
                             "graph_replay_speedup": speedup}

    out = Path(args.out)
    out = out if out.suffix == ".json" else out / "fused_ops_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"\n{record['env'].get('device', 'cuda')}: Qwen2.5-0.5B shapes, bf16")
    print("\ncorrectness (bf16, max |x - the same op in float32|):")
    for r in record["kernel_checks"]:
        print(f"  {r['op']:<22} T={r['T']:<5} fused {r['max_abs_err_fused']:.4f}  torch {r['max_abs_err_torch']:.4f}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
    m = record["model_logits"]
    print(f"  model logits vs float32 (max err / max |logit|): unfused {m['rel_err_unfused']:.4f}, fused "
          f"{m['rel_err_fused']:.4f}; argmax agreement {m['argmax_agree_unfused']:.3f} / {m['argmax_agree_fused']:.3f}"
          f"  {'ok' if m['ok'] else 'FAIL'}")
    print("\nper op (CUDA graph of 20 launches, median of 30 replays):")
    print(f"  {'op':<22} {'T':>5} {'torch us':>9} {'fused us':>9} {'speedup':>8}")
    for r in record["ops"]:
        print(f"  {r['op']:<22} {r['T']:>5} {r['torch_us']:>9.1f} {r['fused_us']:>9.1f} {r['speedup']:>7.2f}x")
    e = record["engine_step"]
    print(f"\nengine decode step, {args.num_seqs} sequences, ~{args.prompt_len + args.skip}+ tokens of context:")
    print(f"  {'':<10} {'graph replay ms':>16} {'step ms (host+device)':>22}")
    for key in ("unfused", "fused"):
        print(f"  {key:<10} {e[key]['graph_replay_ms_median']:>16.3f} {e[key]['step_ms_median']:>22.2f}")
    print(f"  graph replay speedup {e['graph_replay_speedup']:.2f}x; sequences with identical greedy tokens: "
          f"{same}/{args.num_seqs}" + (f", the others first differ at output token {statistics.median(late):.0f} "
                                         "(median; bf16 rounds differently in the fused kernels)" if late else ""))

    print(f"\nwrote {out}")
    ok = all(r["ok"] for r in record["kernel_checks"]) and m["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
