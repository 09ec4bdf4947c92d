"""The GPU benchmark scripts run end to end on tiny shapes here, so they cannot rot between the
rare runs on a GPU: every method they time must produce the reference's result. The kernel research
scripts live beside their records in benchmarks/ (not in the package) and are loaded from there."""
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from minikv.bench import decode_attention, load_script

ROOT = Path(__file__).resolve().parents[1]


def research_script(name: str):
    """benchmarks/<name>.py, imported as a module."""
    return load_script(ROOT / "benchmarks" / f"{name}.py")


decode_variants = research_script("decode_variants")
decode_profile = research_script("decode_profile")
decode_tune = research_script("decode_tune")


@pytest.mark.slow  # every kernel variant through Triton's interpreter on the CPU
def test_decode_attention_benchmark_smoke(tmp_path, capsys):
    record = decode_attention.main(["--smoke", "--no-flex", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode_attention_gpu.json").read_text())
    assert saved["decode"] and saved["prefill"]
    assert all(r["ok"] for r in record["decode"]), [r["rel_err_vs_fp32"] for r in record["decode"]]
    assert all(r["ok"] for r in record["ragged_correctness"])
    assert "triton at" in capsys.readouterr().out


@pytest.mark.slow  # every kernel variant through Triton's interpreter on the CPU
def test_decode_variants_smoke(tmp_path):
    from minikv.kernels import decode_attention as current  # stands in for an earlier version of the file

    record = decode_variants.main(["--smoke", "--splits", "--previous", current.__file__, "--out", str(tmp_path)])
    assert "previous" in record["variants"]
    assert json.loads((tmp_path / "decode_variants_gpu.json").read_text())["shapes"]
    for shape, row in record["shapes"].items():
        for name in ("sdpa_contiguous", "sdpa_tokens_major", *record["variants"]):
            assert row[name]["rel_err"] <= decode_variants.TOL, (shape, name, row[name])
            assert row[name]["us"] > 0
    for shape, m in record["merge"].items():
        assert m["rel_err_new"] <= decode_variants.TOL and m["rel_err_old"] <= decode_variants.TOL, (shape, m)
    for shape, grid in record["split_grid"].items():
        assert grid["best"] and all(g["rel_err"] <= decode_variants.TOL for g in grid["grid"]), (shape, grid)


def test_decode_tune_smoke_checks_every_setting_and_leaves_the_kernel_as_it_was(tmp_path):
    import minikv.kernels.decode_attention as dec

    before = (dec.PROGRAMS_PER_SM, dict(dec.DECODE_CONFIG))
    record = decode_tune.main(["--smoke", "--out", str(tmp_path)])
    tuning = json.loads((tmp_path / "decode_tune_gpu.json").read_text())["tuning"]
    assert record["env"]["device"] and tuning["start"] == {"programs_per_sm": before[0], **before[1]}
    assert len(tuning["configs"]) == 2 and all(c.get("total_us", 0) > 0 for c in tuning["configs"]), tuning
    assert list(tuning["programs_per_sm"]) == ["2", "4"] and list(tuning["programs_per_sm_again"]) == ["4"]
    chosen = tuning["chosen"]
    launch = {k: chosen[k] for k in ("block_n", "num_warps", "num_stages")}
    assert chosen["programs_per_sm"] in (2, 4) and launch in [{k: c[k] for k in launch} for c in tuning["configs"]]
    assert (dec.PROGRAMS_PER_SM, dec.DECODE_CONFIG) == before  # to adopt a choice, edit the defaults


def test_decode_tune_keeps_the_default_unless_something_beats_it_by_more_than_the_noise():
    assert decode_tune.NOISE == 0.02
    assert decode_tune.keep_default({"default": 100.0, "other": 98.5}, "default") == "default"
    assert decode_tune.keep_default({"default": 100.0, "other": 97.0}, "default") == "other"
    assert decode_tune.keep_default({"a": 3.0, "b": 2.0}, "not timed") == "b"


def test_decode_tune_never_chooses_a_setting_that_computes_wrong_numbers(monkeypatch):
    """A launch setting whose output is off (here: doubled) is logged as an error and not chosen."""
    right = decode_tune.triton_decode

    def wrong_at_two_stages(c, **kw):
        fn = right(c, **kw)
        return (lambda: 2 * fn()) if kw.get("num_stages") == 2 else fn

    monkeypatch.setattr(decode_tune, "triton_decode", wrong_at_two_stages)
    case = decode_attention.decode_case(2, 40, 16, torch.float32, torch.device("cpu"), (6, 2, 16))
    clock = decode_attention.Clock(torch.device("cpu"), 1, 0)
    fast = {"block_n": 32, "num_warps": 1, "num_stages": 2}
    log = decode_tune.tune_decode([case], clock, float("inf"), programs_per_sm=(4,), again=(), launch=[fast])
    assert "rel err" in log["configs"][0]["error"], log
    assert log["chosen"] == log["start"]


def test_clock_refuses_an_unknown_flush():
    with pytest.raises(ValueError, match="flush must be"):
        decode_attention.Clock(torch.device("cpu"), 1, 0, flush="sometimes")


def test_decode_profile_counts_the_instructions_that_matter_and_needs_a_gpu():
    ptx = ("cp.async.cg.shared.global [%r1], [%rd2], 0x10, %r3;\ncp.async.wait_group 0;\n"
           "ld.global.v4.b32 {%r4, %r5, %r6, %r7}, [%rd8];\nmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    counts = decode_profile.instruction_counts(ptx)
    assert counts["cp.async (async copy to shared)"] == 1 and counts["ld.global 16-byte"] == 1
    assert counts["mma.sync (tensor cores)"] == 1 and counts["wgmma"] == 0
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            decode_profile.main(["--out", "never-made"])


@pytest.mark.parametrize("script, flag", [("decode_variants", "--previous"), ("decode_tune", "--budget-s"),
                                          ("serve_prefix_ab_gpu", "--loads"), ("host_run_cpu", "--burst"),
                                          ("serve_burst_gpu", "--core-spy"), ("spy_summary", "--top"),
                                          ("eager_step_gpu", "--lengths"), ("decode_gemm_gpu", "--rows")])
def test_research_scripts_run_from_a_checkout_with_nothing_installed(tmp_path, script, flag):
    """`python benchmarks/<script>.py --help` from anywhere: the script finds minikv in its checkout.
    Python runs without site (-S), so the installed minikv (an editable finder) is not seen."""
    site = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    env = {**os.environ, "PYTHONPATH": site, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-S", str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert flag in run.stdout


def test_throughput_benchmark_reports_greedy_and_sampled_defaults_and_tuned_with_their_ratios(tmp_path):
    from minikv.bench import throughput

    out = tmp_path / "throughput.json"
    throughput.main(["--small", "--num-requests", "3", "--skip", "checks,hf_cb,hf_padded", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["errors"] == []
    runs = {(r["sampling"], r["config"]): r for r in record["results"]}
    assert set(runs) == {("greedy", "tuned"), ("greedy", "defaults"), ("sampled", "tuned"), ("sampled", "defaults")}
    assert all(r["complete"] and r["output_tokens"] == record["workload"]["output_tokens"] for r in runs.values())
    assert runs["greedy", "tuned"]["max_num_seqs"] == throughput.TUNED["max_num_seqs"]
    assert runs["greedy", "defaults"]["chosen"], "the defaults run says which sizes the engine chose"
    assert set(record["ratios"]) == {"sampled_over_greedy_tuned", "sampled_over_greedy_defaults",
                                     "defaults_over_tuned_greedy", "defaults_over_tuned_sampled"}


def test_the_floor_counts_weights_per_step_and_each_tokens_context_once():
    from minikv.bench import throughput

    shape = throughput.SMALL_SHAPE
    limits = {"copy_bytes_per_s": 1e9, "bf16_flops_per_s": 1e12}
    one = throughput.floor_seconds(shape, [([1] * 10, 2)], steps=3, limits=limits)
    h, i, v, L, d = 128, 256, 10240, 2, 32
    per_layer = h * d * (4 + 2 * 2) + 4 * d * h + 3 * h * i
    assert one["params"] == L * per_layer + v * h  # tied embeddings counted once
    kv = 2 * L * 2 * d * 2
    assert one["kv_bytes_read"] == kv * (11 + 12)  # the two output tokens see 11 and 12 positions
    assert one["memory_s"] == (3 * one["params"] * 2 + one["kv_bytes_read"]) / 1e9
    assert one["prefill_compute_s"] == 2 * 10 * L * per_layer / 1e12


@pytest.mark.slow  # starts `minikv serve` as a process: seconds
def test_the_gpu_ratios_server_part_measures_several_loads_of_each_side_on_a_tiny_workload(tmp_path):
    """benchmarks/ratios_gpu.py's server-against-offline part, end to end on the CPU: every load of the
    server and every offline run is kept, the medians are of them, and the served tokens equal offline's."""
    ratios = research_script("ratios_gpu")
    reqs = [([5, 6, 7, 8, 9], 6), ([10, 11, 12], 4), ([13, 14, 15, 16], 5)]
    r = ratios.offline_vs_server("tiny-random", tmp_path, loads=2, reqs=reqs, processes=1,
                                 like_for_like={"kv_backend": "paged", "prefix_caching": "hash"}, offline_busy=1,
                                 client="raw")
    assert r["client"] == "raw"
    assert r["loads"] == 2 and len(r["server"]["runs"]) == len(r["offline"]["runs"]) == 2
    assert r["offline_busy_processes"] == 1
    assert r["server"]["failed"] == 0 and r["output_tokens_equal"], r
    assert all(run["output_tokens"] == 15 for run in r["server"]["runs"] + r["offline"]["runs"])
    for side in ("server", "offline"):
        assert r[side]["tok_s"] == pytest.approx(sum(run["tok_s"] for run in r[side]["runs"]) / 2)  # median of 2
        assert [run["preemptions"] for run in r[side]["runs"]] == [0, 0]  # each load's own, from each engine
        for run in r[side]["runs"]:  # each load's engine steps: at least its longest output's, timed inside
            assert run["steps"] >= 6 and 0 < run["ms_per_step"] and 0 < run["busy"] <= 1.0, run
    for run in r["server"]["runs"]:  # the CPU the server process and its engine process took (a tiny load: maybe
        assert run["server_cpu_share"] >= 0 and run["core_cpu_share"] >= 0, run  # no clock tick of either)
    for run in r["server"]["runs"]:  # every request's TTFT, from the client and inside the server's engine: the
        assert 0 < run["core_ttft_mean_s"] < run["ttft_mean_s"], run  # client's includes the engine's
    assert all(0 < run["ttft_mean_s"] for run in r["offline"]["runs"] + r["offline_like_server"]["runs"])
    for run in r["server"]["runs"]:  # where each first token waited: the parts add up to the client's TTFT
        parts = run["ttft_parts_p50_s"]
        assert parts["requests"] == 3 and parts["in_engine"] > 0 and parts["to_engine"] > 0, parts
        assert parts["first_arrival"] > 0 and parts["engine_p50"] > 0, parts
    assert all(run["first_token_p50_s"] > 0 for run in r["offline"]["runs"])
    for run in r["server"]["runs"] + r["offline"]["runs"]:  # the burst's steps by each mark: the engine ran all
        line = run["timeline"]  # 15 prompt tokens and 15 outputs (less the first tokens, the prompts' last step)
        assert line["steps"] == sorted(line["steps"]) and line["tokens"] == sorted(line["tokens"]), line
        assert line["tokens"][-1] <= 12 + 15 and line["steps"][-1] >= 1, line
    assert ratios.core_ttft_mean({"ttft_sum": 1.0, "ttft_count": 2}, {"ttft_sum": 1.9, "ttft_count": 5}) == \
        pytest.approx(0.3)  # (1.9 - 1.0) / 3 requests of this load
    assert ratios.core_ttft_mean({"ttft_sum": None, "ttft_count": None}, {"ttft_sum": 1.0, "ttft_count": 1}) is None
    like = r["offline_like_server"]  # offline again with the server's cache: its own runs, the same tokens
    assert like["options"]["prefix_caching"] == "hash" and len(like["runs"]) == 2 and like["num_blocks"] > 0
    assert all(run["output_tokens"] == 15 and run["steps"] >= 6 for run in like["runs"])
    assert ratios.server_cache([]) == "hash" and ratios.server_cache(["--prefix-caching", "none"]) is None
    old_tree = {"preemptions": 0, "steps": None, "step_seconds": None, "wait_seconds": None}  # no engine clock
    assert ratios.load_figures(old_tree, {**old_tree, "preemptions": 2}, 1.0) == {
        "preemptions": 2, "steps": None, "ms_per_step": None, "busy": None, "host_share": None}
    no_waits = {"preemptions": 0, "steps": 10, "step_seconds": 1.0, "wait_seconds": None}  # a clock, but no waits
    assert ratios.load_figures(no_waits, {**no_waits, "steps": 20, "step_seconds": 1.5}, 1.0)["host_share"] is None
    clock = {"preemptions": 0, "steps": 10, "step_seconds": 1.0, "wait_seconds": 0.5}
    figures = ratios.load_figures(clock, {**clock, "steps": 20, "step_seconds": 2.0, "wait_seconds": 0.75}, 2.0)
    assert figures["ms_per_step"] == pytest.approx(100.0) and figures["busy"] == pytest.approx(0.5)
    assert figures["host_share"] == pytest.approx(0.75), "of a second inside steps, a quarter waited for the device"
    assert all(run["host_share"] is not None and 0 <= run["host_share"] <= 1.0 + 1e-9
               for run in r["server"]["runs"] + r["offline"]["runs"])
    assert ratios.server_cache(["--stream-interval", "8", "--prefix-caching=radix"]) == "radix"
    assert r["memory_wait_s"] == 0.0  # a CPU: no device memory to wait for (and LLM(ckpt) has no pool there)
    assert r["offline"]["num_blocks"] is None
    with pytest.raises(ValueError, match="at least one load"):
        ratios.offline_vs_server("tiny-random", tmp_path, loads=0, reqs=reqs)
    # load k's prompts are rotated by k tokens: the same lengths and outputs, never an earlier load's prompt
    assert ratios.rotated(reqs, 0) == reqs
    assert ratios.rotated(reqs, 1) == [([6, 7, 8, 9, 5], 6), ([11, 12, 10], 4), ([14, 15, 16, 13], 5)]


def test_the_gpu_ratios_decode_and_sampling_parts_measure_on_a_cpu_and_divide_the_right_way():
    """--parts decode,sampling: the decode step's wall clock over the running sequences (the device's figures
    only where there is one), its three ratios from the profiler's figures, and the CPU sampling step's
    ratio from cpu_sampling.py in its own process, with its tokens checked."""
    ratios = research_script("ratios_gpu")
    reqs = [([1, 2, 3, 4], 12), ([5, 6], 9), ([7, 8, 9], 3)]
    r = ratios.decode_step("tiny-random", skip=3, steps=4, reqs=reqs, kv_backend="paged")
    assert r["running_seqs"] == 2 and r["steps"] == 4 and r["wall_ms_per_step"] > 0  # the 3-token one ended
    assert ("device" in r) == torch.cuda.is_available()
    got = ratios.decode_ratios(2.2, {"device_ms_by_family": {"attention": 0.8, "attention merge": 0.1, "matmul": 1.0},
                                     "device_busy_ms_per_step": 2.0}, {"floor_ms": 1.25})
    assert got == pytest.approx({"merge_over_split": 0.125, "merge_exposed_over_split": None, "device_over_floor": 1.6,
                                 "wall_over_device": 1.1})
    # the merge launched early: the profiler's 0.75 ms is mostly its wait; 0.05 ms comes after the split
    split_merge = [(0.0, 0.8, "attention"), (0.1, 0.85, "attention merge"), (0.9, 1.0, "matmul")]
    exposed = research_script("step_profile").exposed_by_family(split_merge)
    assert exposed == pytest.approx({"attention": 0.8, "attention merge": 0.05, "matmul": 0.1})
    assert sum(exposed.values()) == pytest.approx(0.95)  # the busy time: the union of the spans
    assert ratios.decode_ratios(2.2, {"device_ms_by_family": {"attention": 0.8, "attention merge": 0.75},
                                      "exposed_ms_by_family": exposed, "device_busy_ms_per_step": 0.95},
                                {"floor_ms": 1.0})["merge_exposed_over_split"] == pytest.approx(0.0625)
    assert ratios.decode_ratios(1.0, {"device_ms_by_family": {}, "device_busy_ms_per_step": 0.0},
                                {"floor_ms": 1.0})["merge_over_split"] is None
    s = ratios.cpu_sampling(rows=4, vocab=4096, repeats=1, checks=1)
    assert s["tokens_equal_reference"] == [4, 4] and s["sampled_over_greedy"] > 0 and s["vocab"] == 4096
    row = ratios.sampling_row(s)  # the table's rows, as a GPU run prints them
    assert row[0].startswith("CPU sampling") and row[1] == f"{s['sampled_over_greedy']:.2f}" and "4/4" in row[2]
    on_a_gpu = {**r, "device": {"device_ms_by_family": {"attention": 0.8, "attention merge": 0.1},
                                "device_busy_ms_per_step": 2.0},
                "bytes_floor": {"floor_ms": 1.25, "weights_bytes": 1e9, "kv_bytes": 2e9,
                                "copy_bandwidth_bytes_s": 3e12},
                **got, "merge_over_split": None}
    assert [(name, value) for name, value, _ in ratios.decode_rows(on_a_gpu)] == [
        ("decode step: merge / split attention kernel", "n/a"),
        ("decode step: merge's exposed time / split kernel", "n/a"),
        ("decode step: device busy / bytes floor", "1.60"), ("decode step: wall / device busy", "1.10")]


def test_the_second_engine_part_names_where_memory_kept_after_close_was_allocated():
    """ratios_gpu.kept_by_frame on an allocator snapshot's shape: live blocks summed by the project's innermost
    frames (torch's outermost where none is the project's); free blocks and inactive ones not counted."""
    ratios = research_script("ratios_gpu")

    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}
    linear = [frame("/torch/nn/functional.py", 9, "linear"), frame("/x/minikv/model/llama.py", 171, "forward_fused"),
              frame("/x/minikv/model/llama.py", 217, "forward_fused")]
    snapshot = {"segments": [
        {"blocks": [{"state": "active_allocated", "size": 32 << 20, "frames": linear}] * 3
         + [{"state": "inactive", "size": 1 << 30, "frames": linear}]},
        {"blocks": [{"state": "active_allocated", "size": 2 << 20, "frames": [frame("/t/torch/cuda/graphs.py", 1, "g"),
                                                                              frame("/t/torch/x.py", 2, "outer")]},
                    {"state": "active_allocated", "size": 1 << 20}]}]}
    assert ratios.kept_by_frame(snapshot) == {
        "llama.py:171 forward_fused < llama.py:217 forward_fused": 96 << 20, "x.py:2 outer": 2 << 20,
        "before the record": 1 << 20}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_gpu_ratios_cpu_share_reads_a_process_and_its_busiest_child():
    """process_cpu: the CPU seconds of a process (all its threads) and of its busiest child, from /proc: a
    child that burned 0.3 s of CPU (by its own clock) shows at least that, less one clock tick."""
    ratios = research_script("ratios_gpu")
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
            "print('burned', flush=True)\ninput()\n")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "burned"  # (an event: its CPU time is spent, it still lives)
        cpu = ratios.process_cpu(os.getpid())
        assert cpu["core_cpu_s"] >= 0.3 - 2 / os.sysconf("SC_CLK_TCK") and cpu["server_cpu_s"] > 0, cpu
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert ratios.cpu_seconds(child.pid) is None  # gone: no figure, no exception


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_the_gpu_ratios_busy_processes_spin_while_the_block_runs_and_are_gone_after():
    """--offline-busy: each process is spinning (it said so, and it takes CPU) before the block begins, and
    none is left once it ends."""
    ratios = research_script("ratios_gpu")
    with ratios.busy_processes(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        t0 = [ratios.cpu_seconds(p.pid) for p in procs]
        deadline = time.monotonic() + 60
        while not all(ratios.cpu_seconds(p.pid) > t for p, t in zip(procs, t0)):  # an event: their clocks move
            assert time.monotonic() < deadline, "the busy processes took no CPU in 60 s"
            time.sleep(0.05)
    assert all(p.poll() is not None for p in procs)
    with ratios.busy_processes(0) as none:
        assert none == []


def test_the_gpu_ratios_offline_engine_waits_for_the_stopped_servers_memory(monkeypatch):
    """The offline engine fits its pool to the memory free when it starts: the ratios script waits until a
    stopped server's engine process has given its memory back, and refuses to measure if it never does."""
    ratios = research_script("ratios_gpu")
    free = iter([10, 20, 90, 100])
    monkeypatch.setattr(ratios, "free_device_memory", lambda: next(free))
    monkeypatch.setattr(ratios.time, "sleep", lambda s: None)
    assert ratios.wait_for_device_memory(100, slack=10) >= 0  # 10, 20 (short), then 90 (within the slack)
    assert next(free) == 100  # it stopped asking once the memory was back
    monkeypatch.setattr(ratios, "free_device_memory", lambda: 2 << 30)
    with pytest.raises(RuntimeError, match="still running"):
        ratios.wait_for_device_memory(64 << 30, timeout=0.0)


@pytest.mark.slow  # four engines and a reader process: seconds
def test_the_host_run_benchmark_times_all_four_loops_on_the_same_tokens(tmp_path):
    """benchmarks/host_run_cpu.py end to end on a tiny run: offline and the server's loop, without and with
    the hash cache, every loop made the same tokens, the server's loop used this tree's EventWriter, and the
    ratios are of the medians it reports."""
    out = tmp_path / "host_run.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_run_cpu.py"), "--requests", "6",
                          "--max-tokens", "5", "--burst", "2", "--repeats", "1", "--out", str(out)],
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())["runs"][0]
    assert record["tokens_equal"] and record["channel"] == "EventWriter"
    med = record["median_ms_per_step"]
    assert set(med) == {"offline_none", "offline_hash", "server_none", "server_hash"}
    assert all(len(runs) == 1 and runs[0]["tokens"] == 30 for runs in record["runs"].values())  # 6 requests x 5
    assert record["ratios"]["server_none / offline_none"] == round(med["server_none"] / med["offline_none"], 3)


@pytest.mark.slow  # a fresh interpreter imports torch: seconds
def test_a_run_freezes_a_heap_the_interpreter_froze_at_start_and_thaws_it_after(tmp_path):
    """benchmarks/gc_freeze_cpu.py, as CPython 3.12 starts (some objects frozen before minikv is imported):
    while generate() runs, what came after that freeze is frozen too (a full collection walks almost
    nothing), and afterwards nothing stays frozen (the next call has nothing to count)."""
    gc_freeze = research_script("gc_freeze_cpu")
    gc_freeze.main(["--trees", f"this={ROOT}", "--calls", "3", "--out", str(tmp_path / "gc.json")])
    r = json.loads((tmp_path / "gc.json").read_text())["trees"]["this"]
    assert r["frozen_in_run"] > r["start_up_frozen"] + 10 * r["unfrozen_in_run"]
    assert r["frozen_after"] == 0


def test_the_eager_step_benchmark_times_lone_prompts_and_batches_of_each_size(tmp_path):
    """benchmarks/eager_step_gpu.py on the CPU, tiny: a figure for every length and batch asked, in the record."""
    eager = research_script("eager_step_gpu")
    out = tmp_path / "eager.json"
    r = eager.main(["--model", "tiny-random", "--lengths", "20,40", "--batches", "1,3", "--prompt-len", "32",
                    "--options", "{\"block_size\": 8}",
                    "--out", str(out)])
    assert json.loads(out.read_text()) == r and r["options"] == {"block_size": 8}
    assert [k for k in r if k.startswith(("ttft_ms_", "wall_ms_"))] == [
        "ttft_ms_20", "ttft_ms_40", "wall_ms_1x32", "wall_ms_3x32"]
    assert all(r[k] > 0 for k in ("ttft_ms_20", "ttft_ms_40", "wall_ms_1x32", "wall_ms_3x32"))
    # a prompt's greedy tokens do not depend on the step it shares (CPU float32: exactly)
    assert [len(t) for t in r["tokens_alone"]] == [8, 8] and r["tokens_together"] == r["tokens_alone"]


def test_the_spy_summary_charges_each_sample_to_its_thread_leaf_project_line_and_functions():
    """benchmarks/spy_summary.py on py-spy's raw lines: a library leaf is charged to the project's line that
    called it, a function counts once per sample however often it recurs, and a line that is not raw output
    is refused."""
    summary = research_script("spy_summary")
    raw = ("thread (7): MainThread;run (minikv/engine/core.py:10);step (minikv/engine/core.py:20);"
           "select (selectors.py:415) 30\n"
           "thread (7): MainThread;run (minikv/engine/core.py:10);run (minikv/engine/core.py:12);"
           "forward (minikv/model/llama.py:5) 50\n"
           "thread (9): minikv-http;handle (asyncio/events.py:88) 20\n")
    s = summary.summarize(raw)
    assert s["samples"] == 100 and list(s["threads"]) == ["MainThread", "minikv-http"]
    main = s["threads"]["MainThread"]
    assert main["samples"] == 80
    assert main["leaf_lines"] == [["forward (minikv/model/llama.py:5)", 50], ["select (selectors.py:415)", 30]]
    assert main["own_lines"] == [["forward (minikv/model/llama.py:5)", 50], ["step (minikv/engine/core.py:20)", 30]]
    assert main["functions"] == [["run (minikv/engine/core.py)", 80], ["forward (minikv/model/llama.py)", 50],
                                 ["step (minikv/engine/core.py)", 30]]
    assert s["threads"]["minikv-http"]["own_lines"] == [["(none of the project's)", 20]]
    assert summary.summarize("f (a.py:1);g (b.py:2) 3\n")["threads"]["?"]["samples"] == 3  # without --threads
    assert list(summary.summarize("thread (5);f (minikv/a.py:1) 2\n")["threads"]) == ["thread (5)"]  # no name
    with pytest.raises(ValueError, match="raw output"):
        summary.summarize("thread (7): MainThread;f (a.py:1)\n")


def test_the_ingress_benchmark_times_the_servers_route_and_the_same_parsing_bare(tmp_path):
    """benchmarks/serve_ingress_cpu.py: both sides take every request to its (fake engine's) 500."""
    ingress = research_script("serve_ingress_cpu")
    ingress.main(["--rounds", "1", "--requests", "4", "--out", str(tmp_path / "ingress.json")])
    r = json.loads((tmp_path / "ingress.json").read_text())
    assert r["route"]["us_per_request"] > 0 and r["bare"]["us_per_request"] > 0


def test_the_ingress_probe_takes_a_burst_into_each_kind_of_server(tmp_path):
    """benchmarks/ingress_probe_cpu.py: every request of the burst reaches each server (raw asyncio, bare
    ASGI, FastAPI), is parsed there, and is timed from its client's send."""
    probe = research_script("ingress_probe_cpu")
    probe.main(["--rounds", "1", "--requests", "6", "--clients", "1", "--out", str(tmp_path / "probe.json")])
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["raw", "bare", "fastapi"]
    assert all(0 < r["arrive_p50_ms"] <= r["arrive_p99_ms"] <= r["last_after_first_send_ms"] for r in rows), rows
    # the clients of minikv.bench.serve (httpx) against the same server: every request in, timed alike
    probe.main(["--rounds", "1", "--requests", "6", "--clients", "2", "--kinds", "bare", "--client", "httpx",
                "--out", str(tmp_path / "httpx.json")])
    record = json.loads((tmp_path / "httpx.json").read_text())
    assert record["client"] == "httpx" and [r["kind"] for r in record["rows"]] == ["bare"]
    assert 0 < record["rows"][0]["arrive_p50_ms"] <= record["rows"][0]["last_after_first_send_ms"], record


def test_a_step_trace_timeline_counts_the_steps_and_tokens_scheduled_by_each_mark():
    """minikv.engine.step_trace.timeline: steps between start and end only, counted by each mark after start."""
    from minikv.engine.step_trace import timeline

    rows = [(9.9, 50, 1), (10.0, 5, 1), (10.03, 7, 2), (10.12, 1, 2), (10.5, 9, 1)]  # (moment, tokens, seqs)
    assert timeline(rows, 10.0, 10.4) == {"marks_s": [0.05, 0.1, 0.2, 0.3], "steps": [2, 2, 3, 3],
                                          "tokens": [12, 12, 13, 13]}
    assert timeline(rows, 10.0, marks=(1.0,))["tokens"] == [22]  # no end: the last step counts too


@pytest.mark.slow  # SmolLM2 generates a few tokens for 4 prompts: seconds
def test_the_cpu_sampling_benchmark_takes_the_engines_own_rows(smollm2_dir):
    """`cpu_sampling.py --engine-rows`: the logits the engine sampled each row's 2nd token from, captured on
    their way to the sampler (plain or overlapped step), one row a prompt, over SmolLM2's vocabulary."""
    bench = research_script("cpu_sampling")
    logits = bench.engine_logits(4, step=2)
    assert logits.shape == (4, 49_152) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert not torch.equal(logits[0], logits[1])  # each row its own prompt's


def test_the_decode_gemm_benchmark_checks_its_kernel_and_needs_a_gpu_to_time(capsys):
    """The few-rows GEMM of benchmarks/decode_gemm_gpu.py against float64 on tiny shapes (with and without a
    bias and splits over K, tiles the rows and columns do not fill); timing it needs a GPU."""
    gemm = research_script("decode_gemm_gpu")
    assert gemm.smoke() == 0 and "12 cases" in capsys.readouterr().out
    with pytest.raises(ValueError, match="256"):
        gemm.FewRowsGemm(300, 64, 64, 32, 32, 1, 4, torch.device("cpu"))
    narrow = list(gemm.configs(896, 896, 66))  # 896 columns fill the card only when split over K
    assert narrow and all(-(-896 // bn) * sk >= 66 and sk > 1 for bn, _, sk, _ in narrow)
    if not torch.cuda.is_available():
        assert gemm.main([]) == 2 and "no CUDA device" in capsys.readouterr().err


def test_draw_plan_cpu_checks_that_the_kept_plan_packs_what_a_fresh_one_packs():
    r = research_script("draw_plan_cpu").run(seqs=6, number=20)
    assert r["seqs"] == 6 and r["us_per_step"]["fresh"] > 0 and r["us_per_step"]["kept"] > 0
