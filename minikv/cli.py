"""`minikv` on the command line.

    minikv prepare                                   fetch + convert the offline model (once)
    minikv generate --model smollm2-135m --prompt "Why is the sky blue?"
    minikv bench <name> [options]                    run minikv/bench/<name>.py (e.g. cache_speedup)
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minikv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="download and convert the offline SmolLM2-135M-Instruct (once)")
    g = sub.add_parser("generate", help="stream an answer to a prompt")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--kv-backend", default="contiguous")
    g.add_argument("--device", default=None)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b = sub.add_parser("bench", help="run a benchmark from minikv/bench (its own --help lists options)")
    b.add_argument("name", help="benchmark module, e.g. cache_speedup, throughput, prefix_ttft, decode_attention")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    if args.cmd == "bench":
        import importlib.util
        import runpy

        module = f"minikv.bench.{args.name}"
        if importlib.util.find_spec(module) is None:
            import pkgutil

            import minikv.bench

            names = sorted(m.name for m in pkgutil.iter_modules(minikv.bench.__path__))
            print(f"error: no benchmark {args.name!r}; available: {', '.join(names)}", file=sys.stderr)
            return 2
        sys.argv = [module] + args.rest
        runpy.run_module(module, run_name="__main__")
        return 0

    if args.cmd == "prepare":
        from minikv.model.named import prepare_smollm2

        print(prepare_smollm2())
        return 0

    from minikv import LLM, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
        llm = LLM(args.model, device=args.device, kv_backend=args.kv_backend)
        prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
        for ev in llm.stream(prompt, params):
            print(ev.text_delta if llm.tokenizer else f"{ev.token_id} ", end="", flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
