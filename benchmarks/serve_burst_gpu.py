"""Where a burst's time to first token goes on a GPU: `serve_burst_cpu.py`'s stages (client send -> the
server's HTTP stack -> the engine thread -> the core process -> back to the client), with the model and
workload of `ratios_gpu.py`'s server part, against offline `generate` of the same requests.

    python3 benchmarks/serve_burst_gpu.py --out $OUT/serve_burst_gpu.json [--rounds 2] [--requests 256]

Qwen2.5-0.5B shapes (random bf16), the nano-vllm workload's first --requests requests (outputs capped at
--max-tokens), every client arriving at one instant from --clients processes. The server's engine runs
`minikv serve`'s defaults (its own process, the hash prefix cache), offline `LLM(ckpt)`'s; both warmed
first. Each round's prompts are rotated by the round's number, so no round hits an earlier one's in the
server's prefix cache. Prints, per round, TTFT p50 of both and the server's stages (p50, seconds after send).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    from serve_burst_cpu import STAGES, run_offline, run_server
    from spy_summary import summarize

    from minikv.bench import environment
    from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint, workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024, help="outputs capped here")
    ap.add_argument("--clients", type=int, default=8, help="client processes the requests are spread over")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny loads only)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the server's process (its HTTP and engine threads share one "
                         "interpreter lock); default: Python's 0.005 s")
    ap.add_argument("--rows", action="store_true", help="also write every request's stamps, per round, beside --out")
    ap.add_argument("--spy", action="store_true", help="and py-spy's samples of the thread holding the server's "
                    "interpreter lock during the burst (py-spy on PATH; the figures then carry its cost)")
    ap.add_argument("--core-spy", action="store_true", help="and py-spy's samples of the engine process during the "
                    "burst, beside those of offline's process during the same burst; both summed up in the record by "
                    "thread, line and function (benchmarks/spy_summary.py; py-spy on PATH)")
    args = ap.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; serve_burst_cpu.py measures the same stages on a CPU", file=sys.stderr)
        return 2
    ckpt = str(make_random_checkpoint(QWEN25_05B_SHAPE, Path(tempfile.mkdtemp()) / "qwen", dtype=torch.bfloat16))
    reqs = workload()[:args.requests]
    server_options = dict(kv_backend="paged", prefix_caching="hash", device=args.device)  # `minikv serve`'s defaults
    offline_options = {"device": args.device}  # LLM(ckpt)'s defaults
    rounds = []
    for k in range(args.rounds):
        prompts = [p[k:] + p[:k] for p, _ in reqs]
        outputs = [min(n, args.max_tokens) for _, n in reqs]
        if args.rows:  # (serve_burst_cpu.run_server writes them there)
            os.environ["SERVE_BURST_ROWS"] = str(Path(args.out).with_suffix(f".rows{k}.json"))
        if args.spy:
            os.environ["SERVE_BURST_SPY"] = str(Path(args.out).with_suffix(f".spy{k}.txt"))
        spied = {side: Path(args.out).with_suffix(f".{side}spy{k}.txt") for side in ("core", "offline")}
        if args.core_spy:
            os.environ.update({f"SERVE_BURST_{side.upper()}_SPY": str(path) for side, path in spied.items()})
        served = run_server(prompts, outputs, server_options, args.clients, None, model=ckpt, warm=8)
        if args.device == "cuda":
            torch.cuda.empty_cache()
        offline = run_offline(prompts, outputs, offline_options, model=ckpt)
        rounds.append({"server": served, "offline": offline})
        if args.core_spy:  # the engine's own process in the server against offline's, the same burst
            rounds[-1]["spy"] = {side: summarize(path.read_text()) if path.exists() else
                                 {"error": f"py-spy wrote no {path.name}: is it on PATH, and may it trace a process?"}
                                 for side, path in spied.items()}
        st = served["stages_after_send_s"]
        print(f"[burst] round {k}: TTFT p50 server {served['ttft_p50_s']:.3f} s, offline {offline['ttft_p50_s']:.3f} s "
              f"({served['ttft_p50_s'] / offline['ttft_p50_s']:.2f}x), errors {served['errors']}; server stages p50: "
              + ", ".join(f"{s} {st[s]['p50']:.3f}" for s in STAGES if st[s]["p50"] is not None)
              + f"; last arrival {served['last_arrival_after_first_send_s']:.3f} s after the first send", flush=True)
    med = lambda side: float(np.median([r[side]["ttft_p50_s"] for r in rounds]))  # noqa: E731
    record = {"benchmark": "serve_burst_gpu", "label": args.label, **environment(args.device, args.commit),
              "switch_interval_s": sys.getswitchinterval(),
              "workload": {"requests": args.requests, "max_tokens": args.max_tokens, "clients": args.clients,
                           "model": "Qwen2.5-0.5B shapes, random bf16", "server_options": server_options},
              "rounds": rounds, "ttft_p50_server_over_offline": med("server") / med("offline")}
    Path(args.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"[burst] medians: server {med('server'):.3f} s, offline {med('offline'):.3f} s: "
          f"{record['ttft_p50_server_over_offline']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
