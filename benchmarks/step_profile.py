"""Where one engine step's time goes, mid-run: host phases timed by wrappers, device time by the profiler.

    python benchmarks/step_profile.py --out DIR [--label after]            (GPU: Qwen2.5-0.5B shapes, bf16)
    python benchmarks/step_profile.py --cpu --out DIR                       (CPU: a small model, float32)

The run: the first --num-requests requests of the nano-vllm workload, greedy or sampled (T=0.6,
top-p 0.95), paged + Triton + CUDA graphs on a GPU (paged + torch on a CPU). After --skip steps
(prefills done, most sequences decoding) --steps steps are measured:

    step wall time  = schedule + prepare (batch tensors) + forward (launch / graph replay)
                      + sample (waits for the device, then the ids come back) + rest (append, update)

Each phase is timed on the host by wrapping the engine's own functions (Scheduler.schedule,
ModelRunner.prepare_step or prepare, ModelRunner.run, the sampler), so the split is the same for any
engine version that has these names. Async scheduling (where the engine has it) is turned off: the
phases are those of the plain step; benchmarks/async_scheduling_gpu.py measures the overlapped one.
The sample phase is where the host waits for the device: a step whose device time is smaller than
its wall time is host-bound. On a GPU, torch.profiler then records the same number of steps and
sums kernel time per step, grouped by kernel family.

Runs with whichever minikv is on sys.path: PYTHONPATH=path/to/an/older/commit for "before".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "rest")
KERNEL_FAMILIES = (  # substring of the kernel name -> family (first match wins)
    ("_add_rms_norm", "fused (triton)"), ("_rotary_qkv", "fused (triton)"), ("_silu_and_mul", "fused (triton)"),
    ("gemm", "matmul"), ("gemv", "matmul"), ("cutlass", "matmul"), ("nvjet", "matmul"), ("sm90", "matmul"),
    ("xmma", "matmul"), ("_merge", "attention merge"), ("decode", "attention"), ("prefill", "attention"),
    ("store_kv", "kv store"), ("argmax", "sampling"), ("topk", "sampling"), ("sort", "sampling"),
    ("softmax", "sampling"), ("reduce", "reductions"), ("norm", "norms"), ("elementwise", "elementwise"),
    ("vectorized", "elementwise"), ("cat", "elementwise"), ("copy", "copies"), ("memcpy", "copies"),
    ("fused", "fused (triton)"),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for key, f in KERNEL_FAMILIES if key in low), "other")


def exposed_by_family(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Each family's exposed time: the part of its kernels' spans (start, end, family) that no kernel
    started earlier covers; time two kernels share is the earlier one's. The sum over families is the busy
    time (the union of the spans). A kernel launched early by programmatic dependent launch (the decode
    merge) is charged by the profiler for its wait on the kernel before it; its exposed time is what it
    adds to the step."""
    out: dict[str, float] = defaultdict(float)
    reach = float("-inf")  # the furthest end of any kernel started so far
    for a, b, fam in sorted(spans):
        out[fam] += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return dict(out)


class PhaseTimer:
    """Wraps the engine's functions with host timers; `record` turns them on."""

    def __init__(self, llm, sync):
        import minikv.engine.llm as llm_mod

        try:  # the sampler is called from the engine core where there is one, from llm.py before
            import minikv.engine.core as core_mod

            sampler_owner = core_mod if hasattr(core_mod, "sample") else llm_mod
        except ImportError:
            sampler_owner = llm_mod

        self.times: dict[str, list[float]] = defaultdict(list)
        self.record = False
        self.sync = sync
        self.llm = llm
        self._wrap(llm.scheduler, "schedule", "schedule")
        # the batch's tensors: prepare_step where the runner has it (run calls it), prepare before that
        self._wrap(llm.runner, "prepare_step" if hasattr(llm.runner, "prepare_step") else "prepare", "prepare")
        self._wrap(llm.runner, "run", "run")  # prepare's time is taken out of it
        self._wrap(sampler_owner, "sample", "sample")

    def _wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.record:
                self.times[phase].append(time.perf_counter() - t)
            return out

        setattr(owner, name, timed)

    def step(self) -> None:
        t = time.perf_counter()
        self.llm.step()
        if self.record:
            self.times["step"].append(time.perf_counter() - t)

    def summary(self) -> dict:
        n = len(self.times["step"])
        per = {p: sum(self.times[p]) / n * 1e3 for p in ("schedule", "prepare", "run", "sample", "step")}
        out = {"steps": n, "step_ms_median": statistics.median(self.times["step"]) * 1e3,
               "step_ms_mean": per["step"], "schedule_ms": per["schedule"], "prepare_ms": per["prepare"],
               "forward_ms": per["run"] - per["prepare"], "sample_ms": per["sample"]}
        out["rest_ms"] = per["step"] - sum(out[f"{p}_ms"] for p in PHASES if p != "rest")
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def device_profile(llm, steps: int) -> dict:
    """Kernel time per step (torch.profiler over `steps` steps), by family, and the wall time of the same steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by_family: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    host_ops: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0.0)
        if dev_us and e.device_type is not None and "CUDA" in str(e.device_type):
            by_family[family(e.key)] += dev_us
            by_kernel[e.key] += dev_us
        elif e.key.startswith(("cuda", "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::copy_")):
            host_ops[e.key] += e.self_cpu_time_total
    device_ms = sum(by_family.values()) / steps / 1e3
    # busy time: the union of the kernels' spans, so kernels that overlap (the merge launched early with
    # programmatic dependent launch) count once; it is the sum of the families' exposed times
    exposed = exposed_by_family([(e.time_range.start, e.time_range.end, family(e.name)) for e in prof.events()
                                 if e.device_type is not None and "CUDA" in str(e.device_type)
                                 and e.time_range.end > e.time_range.start])
    busy = sum(exposed.values())
    calls: dict[str, int] = defaultdict(int)
    for e in prof.key_averages():
        if e.device_type is not None and "CUDA" in str(e.device_type):
            calls[e.key] += e.count

    def per_step(items) -> dict:
        return {k: round(v / steps / 1e3, 4) for k, v in items}

    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
    kernels = [(k[:90], round(calls[k] / steps, 2), round(v / steps, 2)) for k, v in
               sorted(by_kernel.items(), key=lambda kv: -kv[1])]  # (name, calls per step, us per step)
    return {"steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3), "device_ms_per_step": round(device_ms, 3),
            "device_busy_ms_per_step": round(busy / steps / 1e3, 3), "kernels": kernels,
            "device_ms_by_family": per_step(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "exposed_ms_by_family": per_step(sorted(exposed.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": per_step((k[:90], v) for k, v in top),
            "host_sync_ops_ms": per_step(sorted(host_ops.items(), key=lambda kv: -kv[1])[:8])}


def bytes_floor(llm, context: int, running: int) -> dict:
    """The least time a decode step can take: every weight read once (a tied embedding once, as the LM
    head) and every running sequence's K/V read once, at the card's copy bandwidth. `context`: the
    running sequences' tokens when the profiled steps began."""
    model = llm.runner.model
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    pool = llm.core.pool
    kv_per_token = 2 * pool.num_layers * pool.num_kv_heads * pool.head_dim * pool.k_cache.element_size()
    from minikv.bench.throughput import measure_limits

    bw = measure_limits("cuda")["copy_bytes_per_s"]  # the same 1 GiB copy the throughput floor uses
    kv = context * kv_per_token
    return {"weights_bytes": weights, "kv_bytes": kv, "running_seqs": running, "context_tokens": context,
            "copy_bandwidth_bytes_s": round(bw), "floor_ms": round((weights + kv) / bw * 1e3, 4)}


def run(args) -> dict:
    import minikv
    from minikv import LLM, SamplingParams
    from minikv.bench import throughput as tp

    cpu = args.cpu
    shape = tp.SMALL_SHAPE if cpu else tp.QWEN25_05B_SHAPE
    dev = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    requests = tp.workload(num_requests=args.num_requests, min_len=args.min_len, max_len=args.max_len,
                           max_id=shape["vocab_size"] - 1)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    record = {"benchmark": "step profile", "minikv_file": minikv.__file__, "label": args.label, "device": dev,
              "split_from_bound": args.split_from_bound,
              "card": torch.cuda.get_device_name() if not cpu else "cpu", "torch": torch.__version__,
              "model": "small qwen2 (CPU)" if cpu else "Qwen2.5-0.5B shapes, random bf16",
              "num_requests": len(requests), "skip_steps": args.skip, "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        ckpt = tp.make_random_checkpoint(shape, Path(d) / "m")
        options = dict(kv_backend="paged", max_model_len=2048, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, device=dev, dtype=dtype)
        if cpu:
            options.update(attention="torch", num_blocks=4096)
        options.update(json.loads(args.options))  # e.g. {"fused_ops": false}: the same run without a feature
        record["options"] = options | {"dtype": str(dtype)}
        for mode in args.modes.split(","):
            llm = LLM(str(ckpt), **options)
            if hasattr(type(llm), "async_scheduling"):  # the phases of the plain step, one after the other
                llm.async_scheduling = False
            extra = {} if mode == "greedy" else dict(temperature=0.6, top_p=0.95)
            for p, n in requests:
                llm.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **extra))
            timer = PhaseTimer(llm, sync)
            for _ in range(args.skip):
                timer.step()
            running = len(llm.scheduler.running)
            timer.record = True
            for _ in range(args.steps):
                timer.step()
            timer.record = False
            result = {"running_seqs": running, "phases": timer.summary()}
            if not cpu:
                context = sum(s.num_tokens for s in llm.scheduler.running)
                result["device"] = device_profile(llm, args.profile_steps)
                result["bytes_floor"] = bytes_floor(llm, context, len(llm.scheduler.running))
                result["bytes_floor"]["device_busy_over_floor"] = round(
                    result["device"]["device_busy_ms_per_step"] / result["bytes_floor"]["floor_ms"], 3)
            record["runs"][mode] = result
            print(mode, json.dumps(result)[:600], flush=True)
            del llm, timer  # the timer's wrappers hold the engine: both go, or the next engine finds little memory
            if not cpu:
                torch.cuda.empty_cache()
    return record


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=".")
    ap.add_argument("--label", default="run")
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--skip", type=int, default=150, help="steps run before measuring (prefills out of the way)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--options", default="{}", help='more LLM arguments as JSON, e.g. \'{"fused_ops": false}\'')
    ap.add_argument("--split-from-bound", action="store_true",
                    help="decode split ranges cut from max_seq_len under graphs too (the earlier way)")
    args = ap.parse_args(argv)
    if args.split_from_bound:
        from minikv.attention.triton_backend import TritonPagedBackend

        TritonPagedBackend.decode_split_per_seq = False
    record = run(args)
    out = Path(args.out) / f"step_profile_{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
