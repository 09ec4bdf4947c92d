"""The GPU ratios a change to the step, the server, the prefix cache or the kernels must be checked
against: one call (well inside 10 minutes on an H100), every figure beside its baseline from the same
process and card, tokens checked before anything is timed.

    python3 benchmarks/ratios_gpu.py --out $OUT/ratios_gpu.json [--label before|after]

1. prefix hit: Qwen2.5-0.5B shapes (random bf16), `LLM(ckpt, kv_backend="paged", prefix_caching=...)`
   with the GPU defaults, 8 requests one at a time sharing a prefix + 32 new tokens, engines taking
   turns request by request (off first, then hash and radix in alternating order); warm median time
   to first token of off / hash / radix at 8,192 and 2,048 prefix tokens. Ratio = off / cached.
   Goals: >= 10x at 8,192, >= 5x at 2,048, a hit < 3 ms.
2. server vs engine: the nano-vllm workload (256 requests, prompts and outputs 100-1,024, EOS
   ignored; greedy) through `minikv serve --model ckpt` (its own process) with 256 streaming clients
   at once, then offline through `LLM(ckpt).generate`, --serve-loads times each (default 3: one load
   moves by up to 15% from the next; load k's prompts rotated by k tokens, so that no load finds an
   earlier one's in the server's prefix cache); output tok/s and TTFT p50, the medians and every run.
   Goals: server >= 0.85 of offline, TTFT p50 <= 1.5x. (The server runs its default hash prefix
   cache, `LLM(ckpt)` none: so offline runs again with the server's cache, like for like.) Each load
   records its engine steps, the milliseconds inside them, the engine's busy share and the host's own
   share of a step (the rest: waits for the device; near 1, the host sets the pace) (the server's
   /metrics, offline's `LLM.core`), and the CPU share of the server process and its engine process.
   The clients write their requests by hand, encoded before the clock starts (--client raw, the
   default since 2026-11-28: with httpx the burst's first request reached the engine 53-68 ms after the
   first send on an H200's host, raw 4-16 ms; the client library's time is not the server's).
   --client httpx: the earlier records' clients.
   --offline-busy N: N processes spin on the CPU during every offline run, as the server's clients and
   HTTP process run beside its engine: whether the host itself (a clock shared by busy cores) slows the
   engine's steps alike.
3. a second engine in the same process after `close()`: its num_blocks over the first's. Goal: 1.00.
4. the decode step (--parts decode): `LLM(ckpt)` with its defaults (async scheduling, CUDA graphs) on the
   nano-vllm workload; after 150 steps (prefills done, ~250 sequences decoding) the host's wall clock
   around 50 steps (median), then torch.profiler over 20 more (`step_profile.device_profile`: the union
   of the kernels' spans per step, and kernel time by family) and the bytes floor (`step_profile.bytes_floor`:
   every weight and the running sequences' K/V read once at the card's copy bandwidth). Goals: the split
   attention's merge kernel at most 0.15 of the split kernel, device busy time at most 1.6x the floor,
   wall time at most 1.15x device busy time. The merge is launched early (programmatic dependent launch)
   and the profiler charges it its wait for the split; so the merge is also given by its exposed time,
   the part of its spans that no kernel started earlier covers (`step_profile.exposed_by_family`).
5. CPU sampling (--parts sampling): `cpu_sampling.py` on this host's CPU, one thread, 64 model-like rows of
   a 151,936-token vocabulary: top-p 0.95 at T 0.6 over greedy (medians; tokens checked against the
   sorted path first). Goal: at most 1.1x.

Prints one table of ratios and writes a JSON record (device, versions, commit, every raw figure).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from minikv import LLM, SamplingParams
from minikv.bench import environment, load_script
from minikv.bench.prefix_ttft import build_prompts
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint, workload
from minikv.engine.step_trace import StepTrace, first_steps, timeline


def turns(i: int) -> tuple[str, ...]:
    """The engines' order for request i: caching off first, then hash and radix in turn. The request right
    after an 8k prefill finds the host's caches cold (0.3-0.5 ms more on the lent H100's host, in every
    phase); always the same mode there would charge that to one design."""
    return ("None", "hash", "radix") if i % 2 == 0 else ("None", "radix", "hash")


def prefix_hits(ckpt: str, prefix_len: int, requests: int = 8, suffix_len: int = 32) -> dict:
    max_len = prefix_len + suffix_len + 4
    # room for one request, the cached prefix and every question's blocks (nothing evicted); the rest of
    # the options are the GPU defaults (Triton attention, CUDA graphs, the fitted token budget)
    num_blocks = 2 * -(-max_len // 16) + requests * (-(-suffix_len // 16) + 2)
    engines = {str(m): LLM(ckpt, kv_backend="paged", prefix_caching=m, max_model_len=max_len, block_size=16,
                           num_blocks=num_blocks) for m in (None, "hash", "radix")}
    first = engines["None"]
    prompts = build_prompts(None, first.config.vocab_size, prefix_len, suffix_len, requests)
    warm = build_prompts(None, first.config.vocab_size, prefix_len + suffix_len - 1, 1, 1)[0]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for llm in engines.values():  # kernels, graphs and the allocator warmed on an unrelated prompt
        llm.generate([(t + 17) % 10000 for t in warm], sp)
        if llm.prefix_cache is not None:
            llm.reset_prefix_cache()
    ttft = {k: [] for k in engines}
    tokens = {k: [] for k in engines}
    cached = {k: [] for k in engines}
    for i, prompt in enumerate(prompts):
        for k in turns(i):
            out = engines[k].generate(prompt, sp)[0]
            ttft[k].append(out.time_to_first_token)
            tokens[k].append(out.token_ids)
            cached[k].append(out.num_cached_tokens)
    for llm in engines.values():
        llm.close()
    del engines
    gc.collect()
    torch.cuda.empty_cache()
    med = {k: statistics.median(v[1:]) for k, v in ttft.items()}
    return {"prefix_tokens": prefix_len, "ttft_s": ttft, "warm_median_s": med, "cached_tokens": cached,
            "tokens_identical": {k: tokens[k] == tokens["None"] for k in ("hash", "radix")},
            "ratio": {k: med["None"] / med[k] for k in ("hash", "radix")}}


CLIENT_PROCESSES = 8  # the 256 streaming clients, spread so that the clients are never what is measured


def offline_vs_server(ckpt: str, tmp: Path, server_args: list[str] = (), loads: int = 3,
                      reqs: list[tuple[list[int], int]] | None = None, processes: int = CLIENT_PROCESSES,
                      like_for_like: dict | None = None, offline_busy: int = 0, client: str = "raw") -> dict:
    """The workload `loads` times through `minikv serve` (its own process, warmed with 8 requests), then
    `loads` times offline through `LLM(ckpt)` (warmed alike), load k's prompts rotated by k tokens on both
    sides (`rotated`): every run, and each side's medians. One load of one server moves by up to 15% from
    the next (NOTES_step_profile.md): a ratio from one load each cannot tell 0.80 from 0.90. like_for_like:
    options of a second offline engine, run the same way (the server's prefix cache: the same engine on
    both sides, where `LLM(ckpt)` runs none). offline_busy: that many processes spinning on the CPU during
    every offline run (`busy_processes`), as the server's runs have its client processes and its HTTP
    process beside the engine process: does the host's shared state (clock, caches) slow the engine alike?
    client: the clients' HTTP ("raw": written by hand, encoded before the clock starts, or "httpx";
    minikv.bench.serve.run_load)."""
    from minikv.bench.serve import Req, ServerProcess, pct, run_load, ttft_parts
    from minikv.serve.app import TRACE_ENV

    if loads < 1:
        raise ValueError(f"loads is {loads}; measure at least one load of each side")
    reqs = reqs if reqs is not None else workload()  # [(prompt ids, output length)]: the nano-vllm workload
    free_before = free_device_memory()
    # the server first, in its own process, so that its pool is fitted to an empty card
    trace = tmp / "serve_trace.jsonl"  # each request's first-token moments in the server (ttft_parts)
    steps = tmp / "serve_steps.json"  # each engine step's moment and size (step_trace.py), written at idle
    trace.unlink(missing_ok=True)
    steps.unlink(missing_ok=True)
    os.environ.update({TRACE_ENV: str(trace), "MINIKV_STEP_TRACE": str(steps)})
    try:
        server = ServerProcess(ckpt, list(server_args), tmp / "server.log").wait_ready()
    finally:
        del os.environ[TRACE_ENV], os.environ["MINIKV_STEP_TRACE"]
    served = []
    try:
        name = server_name(server)
        run_load(server.url, name, [Req(0.0, "warm", p, 8) for p, _ in reqs[:8]], client=client)
        for k in range(loads):
            load = [Req(0.0, f"t{i % 4}", p, n) for i, (p, n) in enumerate(rotated(reqs, k))]
            before, cpu_before = server_counters(server), process_cpu(server.proc.pid)
            results, duration = run_load(server.url, name, load, processes=processes, client=client)
            cpu_after, after = process_cpu(server.proc.pid), server_counters(server)
            ok = [r for r in results if r.ok]
            tokens = sum(r.output_tokens for r in ok)
            served.append({"seconds": duration, "output_tokens": tokens, "tok_s": tokens / duration,
                           "ttft_p50_s": pct([r.ttft for r in ok], 50), "failed": len(results) - len(ok),
                           "ttft_mean_s": statistics.fmean(r.ttft for r in ok) if ok else None,
                           "core_ttft_mean_s": core_ttft_mean(before, after),
                           "ttft_parts_p50_s": ttft_parts(ok, trace),
                           "first_send": min(r.sent_at for r in results),
                           "errors": sorted({r.error for r in results if not r.ok})[:3],
                           **load_figures(before, after, duration),
                           **{c.replace("_cpu_s", "_cpu_share"): (cpu_after[c] - cpu_before[c]) / duration
                              if cpu_after[c] is not None and cpu_before[c] is not None else None
                              for c in cpu_after}})
    finally:
        server.stop()
    if steps.exists():  # the burst as the server's engine ran it: steps and tokens by each mark after the first send
        rows = json.loads(steps.read_text())
        for run in served:
            run["timeline"] = timeline(rows, run["first_send"], run["first_send"] + run["seconds"])
            run["first_steps"] = first_steps(rows, run["first_send"], run["first_send"] + run["seconds"])
        loop_path = Path(str(steps) + ".loop.json")
        if loop_path.exists():  # the core's loop: its turns (commands applied, step) and collections, first 400 ms
            loop_rows = json.loads(loop_path.read_text())
            for run in served:
                t = run["first_send"]
                run["core_loop"] = [[r[0]] + [round((x - t) * 1e3, 2) if isinstance(x, float) else x for x in r[1:]]
                                    for r in loop_rows if 0 <= r[1] - t <= 0.4]
    # the offline engine fits its pool to the memory free now: wait until the server's engine process has
    # given its pool back, or offline runs with a smaller pool (preemptions) and the ratio measures that
    memory_wait_s = wait_for_device_memory(free_before)
    offline, num_blocks = offline_runs(ckpt, reqs, loads, busy=offline_busy)
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    out = {"loads": loads, "memory_wait_s": memory_wait_s, "offline_busy_processes": offline_busy, "client": client,
           "offline": {"tok_s": med(offline, "tok_s"), "ttft_p50_s": med(offline, "ttft_p50_s"), "runs": offline,
                       "num_blocks": num_blocks},
           "server": {"tok_s": med(served, "tok_s"), "ttft_p50_s": med(served, "ttft_p50_s"),
                      "failed": sum(r["failed"] for r in served),
                      "errors": sorted({e for r in served for e in r["errors"]}), "runs": served},
           "output_tokens_equal": all(r["output_tokens"] == o["output_tokens"] for r in served for o in offline)}
    if like_for_like is not None:  # offline again, with the server's cache: the same engine on both sides
        runs, blocks = offline_runs(ckpt, reqs, loads, busy=offline_busy, **like_for_like)
        out["offline_like_server"] = {"options": like_for_like, "tok_s": med(runs, "tok_s"),
                                      "ttft_p50_s": med(runs, "ttft_p50_s"), "runs": runs, "num_blocks": blocks}
    return out


def offline_runs(ckpt: str, reqs: list[tuple[list[int], int]], loads: int, busy: int = 0,
                 **options) -> tuple[list[dict], int | None]:
    """`loads` runs of `LLM(ckpt, **options).generate` on the workload (load k rotated by k), after a warm-up
    of 8 requests: each run's figures, and the engine's num_blocks. The engine is closed before it returns.
    busy: processes spinning on the CPU during each run."""
    from minikv.bench.serve import pct

    llm = LLM(ckpt, **options)
    trace = StepTrace()
    llm.add_observer(trace)
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm
    runs = []
    for k in range(loads):
        with busy_processes(busy):
            sync()
            t0 = time.perf_counter()
            before = engine_counters(llm)
            outs = llm.generate([p for p, _ in rotated(reqs, k)], params, use_tqdm=False)
            sync()
            seconds = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        runs.append({"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds,
                     "ttft_p50_s": pct([o.time_to_first_token for o in outs], 50),
                     "ttft_mean_s": statistics.fmean(o.time_to_first_token for o in outs),
                     "timeline": timeline(trace.rows, t0, t0 + seconds),
                     "first_steps": first_steps(trace.rows, t0, t0 + seconds),
                     "first_token_p50_s": pct([o.metrics.token_times[0] for o in outs], 50)  # after the first
                     - min(o.metrics.arrival_time for o in outs),  # arrival: the burst as the engine saw it
                     **load_figures(before, engine_counters(llm), seconds)})
    num_blocks = llm.view.num_blocks if llm.is_paged else None  # (LLM(ckpt) on a CPU: no pool)
    llm.close()
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs, num_blocks


@contextlib.contextmanager
def busy_processes(n: int):
    """n processes that spin on the CPU (pure Python) while the block runs, each started and spinning
    before it begins (it printed a line), all killed when it ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True:\n    pass"],
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    try:
        for p in procs:
            p.stdout.readline()
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
            p.stdout.close()


def rotated(reqs: list[tuple[list[int], int]], k: int) -> list[tuple[list[int], int]]:
    """Load k's requests: each prompt rotated by k tokens (the same lengths, the same work), so that no load
    finds an earlier load's prompts in the server's prefix cache (`minikv serve` runs one by default, the
    offline engine none)."""
    return [(p[k % len(p):] + p[:k % len(p)], n) for p, n in reqs]


def free_device_memory() -> int | None:
    """Bytes free on the GPU now (None on a CPU)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def wait_for_device_memory(free_before: int | None, timeout: float = 60.0, slack: int = 2 << 30) -> float:
    """Wait until the GPU has `free_before` bytes free again, less `slack` (a stopped server's engine process
    may take a moment to exit); seconds waited. Raises after `timeout`: a ratio against an engine with a
    smaller pool would be no ratio at all."""
    t0 = time.perf_counter()
    if free_before is None:
        return 0.0
    while free_device_memory() < free_before - slack:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the GPU has {free_device_memory() / 2**30:.1f} GiB free {timeout:.0f} s after the "
                               f"server stopped, {free_before / 2**30:.1f} GiB before it started: is its engine "
                               f"process still running?")
        time.sleep(0.5)
    return time.perf_counter() - t0


COUNTERS = {"preemptions": "minikv:num_preemptions_total", "steps": "minikv:engine_steps_total",
            "step_seconds": "minikv:engine_step_seconds_total", "wait_seconds": "minikv:engine_wait_seconds_total"}
TTFT_METRIC = "minikv:time_to_first_token_seconds"  # a histogram: its _sum and _count


def server_counters(server) -> dict[str, float | None]:
    """The server's preemptions, engine steps and seconds inside them so far (its /metrics; the engine's
    clock is None for a tree older than it, run with PYTHONPATH)."""
    import httpx

    from minikv.serve.metrics import parse_metrics

    values = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
    if COUNTERS["preemptions"] not in values:
        raise RuntimeError(f"the server's /metrics has no {COUNTERS['preemptions']}")
    return {**{k: values.get(m) for k, m in COUNTERS.items()},
            "ttft_sum": values.get(TTFT_METRIC + "_sum"), "ttft_count": values.get(TTFT_METRIC + "_count")}


def core_ttft_mean(before: dict, after: dict) -> float | None:
    """The mean time to first token the server's engine saw over one load (its /metrics histogram: the
    request's arrival in the engine -> its first token there): against the client's mean, what the
    ingress, the way back and the client took; against offline's, what the engine took."""
    if after.get("ttft_count") is None or before.get("ttft_count") is None:
        return None
    n = after["ttft_count"] - before["ttft_count"]
    return (after["ttft_sum"] - before["ttft_sum"]) / n if n else None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process so far, all its threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> dict[str, float | None]:
    """CPU seconds of the server process (HTTP, SSE, its engine thread) and of its busiest child (the engine
    process), so far: over a load's wall time, how much of a core each kept busy."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children") if Path(f"/proc/{pid}").exists() else []:
        children += [int(c) for c in task.read_text().split()]
    child = max((cpu_seconds(c) or 0.0 for c in children), default=None)
    return {"server_cpu_s": cpu_seconds(pid), "core_cpu_s": child}


def engine_counters(llm) -> dict[str, float | None]:
    """The same counters of an engine in this process."""
    return {"preemptions": llm.view.num_preemptions, "steps": getattr(llm.core, "num_steps", None),
            "step_seconds": getattr(llm.core, "step_seconds", None),
            "wait_seconds": getattr(llm.core, "wait_seconds", None)}


def load_figures(before: dict, after: dict, seconds: float) -> dict:
    """One load's preemptions and engine steps, its milliseconds per step (inside the engine's steps) and
    its busy share (the seconds inside steps over the load's wall time): a server slower than offline
    either runs more steps, or slower ones, or waits between them."""
    d = {k: after[k] - before[k] if after[k] is not None and before[k] is not None else None for k in COUNTERS}
    if d["steps"] is None or d["step_seconds"] is None:  # an older tree: no engine clock
        return {"preemptions": int(d["preemptions"]), "steps": None, "ms_per_step": None, "busy": None,
                "host_share": None}
    return {"preemptions": int(d["preemptions"]), "steps": int(d["steps"]),
            "ms_per_step": d["step_seconds"] / d["steps"] * 1e3 if d["steps"] else None,
            "busy": d["step_seconds"] / seconds,
            # the host's own share of the time inside steps (the rest: waits for the device); None: an older tree
            "host_share": (1 - d["wait_seconds"] / d["step_seconds"]) if d.get("wait_seconds") is not None
            and d["step_seconds"] else None}


def decode_step(ckpt: str, skip: int = 150, steps: int = 50, profile_steps: int = 20,
                reqs: list[tuple[list[int], int]] | None = None, **options) -> dict:
    """Part 4 (the docstring): the decode step's wall time and, on a GPU, its device time, the bytes floor
    and the three ratios (`decode_ratios`). options: more LLM arguments (the defaults otherwise)."""
    step_profile = load_script(Path(__file__).with_name("step_profile.py"))
    llm = LLM(ckpt, **options)
    try:
        for prompt, n in reqs if reqs is not None else workload():
            llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        for _ in range(skip):
            llm.step()
        sync()
        walls = []
        for _ in range(steps):
            t = time.perf_counter()
            llm.step()
            walls.append(time.perf_counter() - t)
        sync()
        running = llm.scheduler.running
        out = {"skip": skip, "steps": steps, "running_seqs": len(running), "async_scheduling": llm.async_scheduling,
               "wall_ms_per_step": statistics.median(walls) * 1e3}
        if torch.cuda.is_available():
            context = sum(s.num_tokens for s in running)  # the K/V the profiled steps read, as they begin
            out["bytes_floor"] = step_profile.bytes_floor(llm, context, len(running))
            out["device"] = step_profile.device_profile(llm, profile_steps)
            out.update(decode_ratios(out["wall_ms_per_step"], out["device"], out["bytes_floor"]))
    finally:
        llm.close()
    return out


def decode_ratios(wall_ms: float, device: dict, floor: dict) -> dict:
    """The decode step's goals from `step_profile.device_profile`'s figures (kernel time by family per step,
    busy time: the union of the kernels' spans) and its bytes floor: merge over split attention kernel,
    busy time over the floor, wall time over busy time (None where a figure is missing)."""
    family, busy = device["device_ms_by_family"], device["device_busy_ms_per_step"]
    split = family.get("attention", 0.0)
    exposed = device.get("exposed_ms_by_family")
    return {"merge_over_split": family.get("attention merge", 0.0) / split if split else None,
            "merge_exposed_over_split": exposed.get("attention merge", 0.0) / split if split and exposed else None,
            "device_over_floor": busy / floor["floor_ms"] if floor["floor_ms"] else None,
            "wall_over_device": wall_ms / busy if busy else None}


def cpu_sampling(rows: int = 64, vocab: int = 151_936, repeats: int = 9, checks: int = 4) -> dict:
    """Part 5: `cpu_sampling.py` in a process of its own at one thread (OMP_NUM_THREADS=1, as its records
    are), on this host's CPU: sampled over greedy, and its tokens checked against the sorted path."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "cpu_sampling.json"
        subprocess.run([sys.executable, str(Path(__file__).with_name("cpu_sampling.py")), "--rows", str(rows),
                        "--vocab", str(vocab), "--threads", "1", "--repeats", str(repeats), "--checks", str(checks),
                        "--out", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
        record = json.loads(out.read_text())
    row = record["results"][0]
    return {"rows": rows, "vocab": vocab, "cpu": record["environment"]["device"],
            "sampled_over_greedy": row["sampled_over_greedy"], "median_ms": row["median_ms"],
            "tokens_equal_reference": record["tokens_equal_reference"], "path": record.get("path", "blocks")}


def decode_rows(r: dict) -> list[tuple[str, str, str]]:
    """The table's rows of the decode part (`decode_step`'s figures, on a GPU)."""
    dev, floor = r["device"], r["bytes_floor"]
    return [("decode step: merge / split attention kernel", ratio_text(r["merge_over_split"]),
             f"{dev['device_ms_by_family'].get('attention merge', 0.0):.3f} / "
             f"{dev['device_ms_by_family'].get('attention', 0.0):.3f} ms per step, "
             f"{r['running_seqs']} sequences decoding"),
            ("decode step: merge's exposed time / split kernel", ratio_text(r.get("merge_exposed_over_split")),
             f"{dev.get('exposed_ms_by_family', {}).get('attention merge', 0.0):.3f} ms per step not overlapped by "
             f"an earlier kernel (the profiler charges the merge its wait for the split)"),
            ("decode step: device busy / bytes floor", ratio_text(r["device_over_floor"]),
             f"{dev['device_busy_ms_per_step']:.3f} / {floor['floor_ms']:.3f} ms (weights "
             f"{floor['weights_bytes'] / 1e9:.2f} GB + K/V {floor['kv_bytes'] / 1e9:.2f} GB at "
             f"{floor['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s)"),
            ("decode step: wall / device busy", ratio_text(r["wall_over_device"]),
             f"{r['wall_ms_per_step']:.3f} / {dev['device_busy_ms_per_step']:.3f} ms (async scheduling "
             f"{'on' if r['async_scheduling'] else 'off'})")]


def sampling_row(r: dict) -> tuple[str, str, str]:
    """The table's row of the sampling part (`cpu_sampling`'s figures)."""
    med, (equal, total) = r["median_ms"], r["tokens_equal_reference"]
    return ("CPU sampling, top-p / greedy (1 thread)", ratio_text(r["sampled_over_greedy"]),
            f"{med['sampled']:.1f} / {med['greedy']:.1f} ms ({r.get('path', 'blocks')} path; the block search in "
            f"torch ops {med.get('torch_path', float('nan')):.1f} ms), {r['rows']} rows of {r['vocab']:,}, {r['cpu']}; "
            f"tokens equal to the sorted path {equal}/{total}")


def ratio_text(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def server_name(server) -> str:
    import httpx

    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def second_engine(ckpt: str) -> dict:
    """Part 3: two engines one after the other; with memory still allocated after the first's close(), where
    it was allocated (torch's allocator history, recorded while the first engine lived: `kept_by_frame`)."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        first = LLM(ckpt)
        n1 = first.stats()["config"]["num_blocks"]
        first.close()
        after_close = torch.cuda.memory_allocated() - base  # pool, graphs and (unshared) weights all given back
        kept = kept_by_frame(torch.cuda.memory._snapshot()) if after_close > 0 else {}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del first
    gc.collect()
    torch.cuda.empty_cache()
    second = LLM(ckpt)
    n2 = second.stats()["config"]["num_blocks"]
    second.close()
    return {"first_num_blocks": n1, "second_num_blocks": n2, "ratio": n2 / n1,
            "allocated_after_close_bytes": after_close, "kept_by_frame": kept}


def kept_by_frame(snapshot: dict, top: int = 5) -> dict[str, int]:
    """Bytes of the allocator's live blocks by where they were allocated: the project's innermost frames (up
    to 3, innermost first), or torch's outermost one where no frame is the project's. Blocks allocated
    before the history was recorded have no frames ("before the record")."""
    out: dict[str, int] = defaultdict(int)
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            ours = [f for f in frames if "minikv" in f["filename"] or "benchmarks" in f["filename"]][:3]
            where = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in ours or frames[-1:]]
            out[" < ".join(where) or "before the record"] += block["size"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])


class Rows(list):
    """The table's rows, each also printed as it is measured (a part that fails leaves the others)."""

    def append(self, row: tuple[str, str, str]) -> None:
        super().append(row)
        print(f"[ratios] {row[0]}: {row[1]} ({row[2]})", flush=True)

    def table(self) -> None:
        print(f"\n{'ratio':44s} {'value':>8s}  detail")
        for name, value, detail in self:
            print(f"{name:44s} {value:>8s}  {detail}")


def host_cpus() -> dict:
    """The host's processors as the engine's processes see them: a server, its engine process and the
    benchmark's client processes share them (hardware threads of one core run at a fraction each)."""
    siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    text = siblings.read_text().strip() if siblings.exists() else ""
    per_core = sum(int(b) - int(a) + 1 if "-" in part else 1
                   for part in text.split(",") if part for a, _, b in [part.partition("-")]) if text else None
    return {"logical": os.cpu_count(), "usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "threads_per_core": per_core, "client_processes": CLIENT_PROCESSES}


def server_cache(server_args: list[str]) -> str | None:
    """The prefix cache `minikv serve` runs with these flags (its default: hash), as LLM's option."""
    cache = "hash"
    for i, a in enumerate(server_args):
        if a == "--prefix-caching" and i + 1 < len(server_args):
            cache = server_args[i + 1]
        elif a.startswith("--prefix-caching="):
            cache = a.split("=", 1)[1]
    return None if cache == "none" else cache


def med_of(r: dict, side: str) -> float:
    """The median over one side's runs of the engine's milliseconds per step."""
    return statistics.median(x["ms_per_step"] or 0.0 for x in r[side]["runs"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--parts", default="prefix,serve,second,decode,sampling",
                    help="comma-separated: prefix, serve, second, decode, sampling")
    ap.add_argument("--server-args", default="", help="more `minikv serve` flags, e.g. --no-engine-process")
    ap.add_argument("--serve-loads", type=int, default=3, help="loads of the server, and offline runs (medians)")
    ap.add_argument("--offline-busy", type=int, default=0,
                    help="processes spinning on the CPU during each offline run (the server's runs have 8 client "
                         "processes and its HTTP process beside the engine): 9 loads the host alike")
    ap.add_argument("--client", default="raw", choices=["raw", "httpx"],
                    help="the clients' HTTP: httpx, or raw (requests written by hand, encoded before the clock "
                         "starts: no client library's CPU time in the server's TTFT)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device; this script measures the GPU ratios (run it on the GPU machine)", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    tmp = Path(tempfile.mkdtemp())
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, tmp / "qwen2.5-0.5b-random", dtype=torch.bfloat16))
    record = {"benchmark": "ratios_gpu", "label": args.label, **environment("cuda", args.commit),
              "host_cpus": host_cpus()}
    rows = Rows()

    def save() -> None:  # after every part: a later part that fails leaves the earlier ones' figures on file
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    if "prefix" in parts:
        for n in (8192, 2048):
            r = prefix_hits(ckpt, n)
            record[f"prefix_{n}"] = r
            for k in ("hash", "radix"):
                rows.append((f"prefix hit TTFT {n}, {k}: off / hit", f"{r['ratio'][k]:.2f}x",
                             f"off {r['warm_median_s']['None'] * 1e3:.1f} ms, "
                             f"hit {r['warm_median_s'][k] * 1e3:.1f} ms, "
                             f"tokens identical {r['tokens_identical'][k]}"))
    save()
    if "serve" in parts:
        server_args = args.server_args.split()
        r = offline_vs_server(ckpt, tmp, server_args, loads=args.serve_loads,
                              like_for_like={"prefix_caching": server_cache(server_args)},
                              offline_busy=args.offline_busy, client=args.client)
        record["serve"] = r
        each = lambda side, k, f: " / ".join(f.format(x[k]) for x in r[side]["runs"])  # noqa: E731
        rows.append(("server / offline output tok/s", f"{r['server']['tok_s'] / r['offline']['tok_s']:.2f}",
                     f"medians of {r['loads']}: server {r['server']['tok_s']:,.0f} "
                     f"({each('server', 'tok_s', '{:,.0f}')}), "
                     f"offline {r['offline']['tok_s']:,.0f} ({each('offline', 'tok_s', '{:,.0f}')}) tok/s, "
                     f"failed {r['server']['failed']}, preemptions server {each('server', 'preemptions', '{}')} "
                     f"offline {each('offline', 'preemptions', '{}')}, offline num_blocks "
                     f"{r['offline']['num_blocks'] or 0:,} after {r['memory_wait_s']:.1f} s waiting for the "
                     f"server's memory; offline beside {r['offline_busy_processes']} busy processes; "
                     f"clients: {r['client']}"))
        ms = lambda side: " / ".join(f"{x['steps']} x {x['ms_per_step'] or 0:.2f} ms, busy {x['busy'] or 0:.2f}"  # noqa: E731
                                     + (f", host {x['host_share']:.2f}" if x.get("host_share") is not None else "")
                                     for x in r[side]["runs"])
        share = lambda k: " / ".join(f"{x[k]:.2f}" if x.get(k) is not None else "?"  # noqa: E731
                                     for x in r["server"]["runs"])
        offline_ms = med_of(r, "offline")
        per_step = med_of(r, "server") / offline_ms if offline_ms else None  # (None: an old tree, no engine clock)
        rows.append(("server / offline ms per step", f"{per_step:.2f}" if per_step else "n/a",
                     f"steps x ms inside each, busy share (and the host's own share of a step, the rest waits for "
                     f"the device): server {ms('server')}; offline {ms('offline')}; "
                     f"CPU share of the server process {share('server_cpu_share')}, of its engine process "
                     f"{share('core_cpu_share')}"))
        like = r["offline_like_server"]
        rows.append((f"server / offline with its cache ({like['options']['prefix_caching']})",
                     f"{r['server']['tok_s'] / like['tok_s']:.2f}",
                     f"offline {like['tok_s']:,.0f} ({each('offline_like_server', 'tok_s', '{:,.0f}')}) tok/s, "
                     f"TTFT p50 {like['ttft_p50_s']:.2f} s: server / it "
                     f"{r['server']['ttft_p50_s'] / like['ttft_p50_s']:.2f}"))
        rows.append(("server / offline TTFT p50", f"{r['server']['ttft_p50_s'] / r['offline']['ttft_p50_s']:.2f}",
                     f"medians: server {r['server']['ttft_p50_s']:.2f} s ({each('server', 'ttft_p50_s', '{:.2f}')}), "
                     f"offline {r['offline']['ttft_p50_s']:.2f} s ({each('offline', 'ttft_p50_s', '{:.2f}')})"))
        mean = lambda side, k: " / ".join(f"{x[k] * 1e3:.0f}" if x.get(k) is not None else "?"  # noqa: E731
                                          for x in r[side]["runs"])
        rows.append(("server TTFT mean: the client's / its engine's", "ms",
                     f"client {mean('server', 'ttft_mean_s')}, the server's engine (arrival there -> first token "
                     f"there) {mean('server', 'core_ttft_mean_s')}; offline {mean('offline', 'ttft_mean_s')}, "
                     f"offline with its cache {mean('offline_like_server', 'ttft_mean_s')}"))
        split = lambda x: ", ".join(f"{k} {v * 1e3:.0f}" for k, v in x.items() if k != "requests" and v is not None)  # noqa: E731
        rows.append(("server TTFT p50 by part", "ms",
                     " / ".join(f"[{split(x['ttft_parts_p50_s'])}]" for x in r["server"]["runs"]) +
                     f"; offline first token p50 after the first arrival {mean('offline', 'first_token_p50_s')}"))
        marks = lambda side: " / ".join(  # noqa: E731
            " ".join(f"{n}:{k / 1e3:.0f}k" for n, k in zip(x["timeline"]["steps"], x["timeline"]["tokens"]))
            for x in r[side]["runs"] if x.get("timeline"))
        rows.append(("steps:tokens scheduled by 50/100/200/300 ms after the burst's start", "",
                     f"server {marks('server') or '(no step trace came back)'}; offline {marks('offline')}"))
    save()
    if "second" in parts:
        r = second_engine(ckpt)
        record["second_engine"] = r
        rows.append(("second engine num_blocks / first", f"{r['ratio']:.3f}",
                     f"{r['second_num_blocks']:,} / {r['first_num_blocks']:,}"))
        kept = "; ".join(f"{size / 2**20:.0f} MiB at {where}" for where, size in r["kept_by_frame"].items())
        rows.append(("GPU memory still allocated after close()", f"{r['allocated_after_close_bytes'] / 2**20:.0f} MiB",
                     "the pool, graphs and weights of an engine that shares nothing"
                     + (f"; allocated at: {kept}" if kept else "")))
    save()
    if "decode" in parts:
        record["decode"] = r = decode_step(ckpt)
        for row in decode_rows(r):
            rows.append(row)
    save()
    if "sampling" in parts:
        record["cpu_sampling"] = r = cpu_sampling()
        rows.append(sampling_row(r))
    save()
    rows.table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
