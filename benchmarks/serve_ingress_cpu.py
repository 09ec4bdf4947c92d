"""What a request costs the server's event loop before the engine sees it, in one process and without
sockets: `minikv serve`'s FastAPI route (body, JSON, checks, tenants, admission, up to `engine.submit`)
against the same JSON and request parsing in a bare ASGI callable.

    PYTHONPATH=. python benchmarks/serve_ingress_cpu.py [--out benchmarks/serve_ingress_cpu.json]

A fake engine answers "failed" at once, so both sides end in a small 500 and nothing is generated. The
requests are the burst benchmarks' shape: 256 prompts of 100-1,024 token ids. The difference between the
two is the web framework's share of the ingress; the HTTP parsing of the socket (uvicorn's) comes on top
of both (`serve_burst_cpu.py --profile` shows it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # run as a script: minikv from this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minikv.serve.app import build_app  # noqa: E402
from minikv.serve.engine_loop import Event  # noqa: E402
from minikv.serve.metrics import ServerMetrics  # noqa: E402
from minikv.serve.protocol import parse_request  # noqa: E402


class FakeEngine:
    """What the routes read of an engine loop; every request fails at once."""

    def __init__(self):
        self.llm = SimpleNamespace(tokenizer=None, max_model_len=4096, loaded=SimpleNamespace(source="x"),
                                   encode=lambda p: (list(p), None, None))
        self.metrics = ServerMetrics()
        self.alive = True
    def num_queued(self, tenant=None):
        return 0

    def free_seats(self):
        return 1000

    def submit(self, prompt, params, tenant, rid, on_event):
        on_event(Event("failed", error=RuntimeError("no engine here")))

    def abort(self, rid):
        pass


def bodies(n: int) -> list[bytes]:
    random.seed(0)
    return [json.dumps({"model": "m", "prompt": [random.randint(3, 500) for _ in range(random.randint(100, 1024))],
                        "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
            for _ in range(n)]


async def call(app, body: bytes) -> int:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)
    await app(scope, receive, send)
    return sent[0]["status"]


async def bare(scope, receive, send) -> None:
    """The same JSON and request parsing, no framework."""
    msg = await receive()
    parse_request(json.loads(msg["body"]), False, ["m"], msg["body"])  # the raw bytes, as the route passes them
    await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": "x"}'})

async def measure(rounds: int, requests: int) -> dict:
    app, reqs, out = build_app(FakeEngine(), "m"), bodies(requests), {}
    for name, target in (("route", app), ("bare", bare)):
        for b in reqs[:16]:  # warm
            await call(target, b)
        per_request = []
        for _ in range(rounds):
            t = time.perf_counter()
            statuses = {await call(target, b) for b in reqs}
            per_request.append((time.perf_counter() - t) / len(reqs))
        assert statuses == {500}, statuses
        out[name] = {"us_per_request": 1e6 * statistics.median(per_request), "runs_us": [1e6 * x for x in per_request]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    r = asyncio.run(measure(args.rounds, args.requests))
    print(f"the server's route: {r['route']['us_per_request']:.0f} us per request; the same parsing bare: "
          f"{r['bare']['us_per_request']:.0f} us ({r['route']['us_per_request'] / r['bare']['us_per_request']:.1f}x)")
    if args.out:
        from minikv.bench import environment

        Path(args.out).write_text(json.dumps({"benchmark": "serve_ingress_cpu", "environment": environment("cpu"),
                                              "requests": args.requests, **r}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
