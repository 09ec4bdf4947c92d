"""A prefix hit's whole step on the GPU, device time only: the CUDA graph of the hit's step replayed
and timed with CUDA events, its query-row attention by the decode kernel (one row per token) or the
grouped kernel (paged_query_rows_attention) at several split counts, in one run.

    python3 benchmarks/query_rows_step_gpu.py [--prefixes 2048,8192] [--out FILE.json]

Qwen2.5-0.5B shapes (random bf16), radix prefix caching, the workload of benchmarks/ratios_gpu.py: a
shared prefix, then a request of the prefix plus 32 new tokens. The hit's step (32 tokens over the
cached prefix) runs through StepGraphs, whose graph holds that step's inputs after the request; the
graph is then replayed --replays times (the median of CUDA-event times). No host work is in the
figure: it is what the time to first token cannot be less than. Tokens are checked equal across
variants first; the graph is captured afresh for each variant.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minikv.kernels.query_rows_attention as qr  # noqa: E402
from benchmarks.fused_ops_gpu import replay_ms  # noqa: E402  (a graph's replays, medians of CUDA events)
from minikv import LLM, SamplingParams  # noqa: E402
from minikv.bench import environment  # noqa: E402
from minikv.bench.prefix_ttft import build_prompts  # noqa: E402
from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", default="2048,8192")
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--splits", default="auto,8,16,32")
    ap.add_argument("--rows", default="16", help="query rows per group of the grouped kernel, comma-separated")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tempfile.mkdtemp()) / "qwen"))
    variants = [("decode", None, None)] + [("grouped", None if s == "auto" else int(s), int(r))
                                           for r in args.rows.split(",") for s in args.splits.split(",")]
    variants.append(("decode", None, None))  # again last: the card's drift over the run
    results = []
    for prefix in map(int, args.prefixes.split(",")):
        max_len = prefix + args.suffix + 4
        llm = LLM(ckpt, kv_backend="paged", prefix_caching="radix", max_model_len=max_len, block_size=16,
                  num_blocks=2 * -(-max_len // 16) + 64)
        prompts = build_prompts(None, llm.config.vocab_size, prefix, args.suffix, 2)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        graphs, want = llm.runner.step_graphs, None
        for impl, splits, rows in variants:
            llm.backend.query_rows_impl, llm.backend.query_rows_num_splits = impl, splits
            qr.QUERY_ROWS_CONFIG["rows"] = rows or 16
            graphs.graphs.clear()  # captured afresh with this variant's kernels
            llm.reset_prefix_cache()
            llm.generate(prompts[0], sp)  # caches the prefix (and its own suffix, which the hit does not share)
            out = llm.generate(prompts[1], sp)[0]  # the hit: its step's inputs stay in the graph's buffers
            assert out.num_cached_tokens >= prefix - 16, out.num_cached_tokens
            want = want or out.token_ids
            if out.token_ids != want:
                raise SystemExit(f"{impl} splits={splits}: tokens differ from the decode kernel's at {prefix}")
            bucket = graphs.bucket(args.suffix)
            ms = replay_ms(graphs.graphs[(bucket, "grouped") if impl == "grouped" else bucket], args.replays)
            results.append({"prefix": prefix, "impl": impl, "rows": rows, "splits": splits or "auto",
                            "step_device_ms": ms})
            base = next(r["step_device_ms"] for r in results if r["prefix"] == prefix)
            print(f"[query rows] prefix {prefix}: {impl:8} rows {str(rows or '-'):>3} splits "
                  f"{str(splits or 'auto'):>5}: hit step {ms:.3f} ms on the device "
                  f"({base / ms:.2f}x the decode kernel's)", flush=True)
        llm.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "query_rows_step_gpu", **environment(),
                                              "suffix": args.suffix, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
