"""`minikv` on the command line.

    minikv prepare                                   fetch + convert the offline model (once)
    minikv generate --model smollm2-135m --prompt "Why is the sky blue?"
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
    args = ap.parse_args(argv)

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
