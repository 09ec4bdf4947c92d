"""How fast can one Python process take in a burst? `serve_burst_cpu.py`'s clients (each request its own
connection, all sent at one instant) against three servers that only take requests in, no engine:

    raw      asyncio streams: read the head and the body, json.loads, answer one SSE line
    bare     uvicorn (h11 on asyncio, or --http httptools on uvloop) with a bare ASGI callable doing the same
    fastapi  uvicorn with a FastAPI route doing the same (Request.body(), StreamingResponse)

    PYTHONPATH=. python benchmarks/ingress_probe_cpu.py [--kinds raw,bare,fastapi] [--rounds 2]
        [--requests 256] [--clients 2] [--http h11|httptools] [--client raw|httpx]
        [--out benchmarks/ingress_probe_cpu.json]

Printed per server: p50 / p99 of (body parsed - client's send) and the last arrival after the first send.
What it shows: the floor under `minikv serve`'s own ingress on this machine (its "arrive" stage is
stamped before the body is read, so it is earlier than this probe's).
"""

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

from benchmarks.serve_burst_cpu import pct, workload  # noqa: E402


def _raw(arrived, report) -> None:
    async def handle(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).lower().split(b"\r\n")
        size = int(next(h for h in head if h.startswith(b"content-length")).split(b":")[1])
        bid = int(next(h for h in head if h.startswith(b"x-burst-id")).split(b":")[1])
        json.loads(await reader.readexactly(size))
        arrived(bid)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {}\n\n")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=2048)
        report({"port": server.sockets[0].getsockname()[1]})
        await asyncio.sleep(3600)
    asyncio.run(main())


def _asgi(arrived, report, kind: str, http: str = "h11") -> None:
    import socket

    import uvicorn

    async def bare(scope, receive, send):
        if scope["type"] != "http":
            return
        bid = next(int(v) for k, v in scope["headers"] if k == b"x-burst-id")
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m.get("body", b""), m.get("more_body", False)
        json.loads(body)
        arrived(bid)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n"})

    app = bare
    if kind == "fastapi":
        from fastapi import FastAPI, Request
        from fastapi.responses import StreamingResponse

        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            bid = int(request.headers["x-burst-id"])
            json.loads(await request.body())
            arrived(bid)

            async def chunks():
                yield b"data: {}\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, named to the caller once the server listens
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", http=http,
                                            loop="uvloop" if http == "httptools" else "asyncio", backlog=2048))

    async def main():
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        report({"port": sock.getsockname()[1]})
        await task
    asyncio.run(main())


async def _httpx_client(url: str, jobs: list[dict], start_at: float) -> list[dict]:
    """The jobs as `minikv.bench.serve` (and so `ratios_gpu.py`) sends them: httpx, one stream each, the body
    encoded by the library after the send is stamped. Against the raw client: what the library costs."""
    import httpx

    async def one(http, job: dict) -> dict:
        out = {"id": job["id"], "send": time.perf_counter(), "error": None}
        body = {"model": "tiny", "prompt": job["prompt"], "max_tokens": job["max_tokens"], "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            async with http.stream("POST", url + "/v1/completions", json=body,
                                   headers={"x-burst-id": str(job["id"])}) as r:
                await r.aread()
        except httpx.HTTPError as e:  # reported per request
            out["error"] = f"{type(e).__name__}: {e}"
        return out

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return await asyncio.gather(*(one(http, j) for j in jobs))


def httpx_client_main() -> None:
    spec = json.load(sys.stdin)
    print(json.dumps(asyncio.run(_httpx_client(spec["url"], spec["jobs"], spec["start_at"]))))


def _serve(kind: str, n: int, http: str = "h11") -> None:
    """(A subprocess, killed by the caller.) {"port": its port} once listening, then, once n requests are
    in, their arrival times: on stdout, as JSON lines."""
    arrive: dict[int, float] = {}

    def report(what) -> None:
        print(json.dumps(what), flush=True)

    def arrived(bid: int) -> None:  # request bid is parsed: stamped, and once all n are, reported
        arrive[bid] = time.perf_counter()
        if len(arrive) == n:
            report(arrive)
    if kind == "raw":
        _raw(arrived, report)
    else:
        _asgi(arrived, report, kind, http)


def one_round(kind: str, prompts: list, clients: int, http: str = "h11", client: str = "raw") -> dict:
    n = len(prompts)
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--requests", str(n), "--http", http],
                              stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(server.stdout.readline() or "null")
        if not isinstance(ready, dict):
            raise RuntimeError(f"the {kind} server did not start")
        port = ready["port"]
        start_at = time.perf_counter() + 0.5  # every client sends at this instant (one clock on Linux)
        jobs = [{"id": i, "prompt": p, "max_tokens": 1} for i, p in enumerate(prompts)]
        procs = []
        for c in range(clients):
            spec = {"url": f"http://127.0.0.1:{port}", "jobs": jobs[c::clients], "start_at": start_at}
            main_of = ("benchmarks.serve_burst_cpu import client_main" if client == "raw" else
                       "benchmarks.ingress_probe_cpu import httpx_client_main as client_main")
            p = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                                  f"from {main_of}; client_main()", str(ROOT)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            p.stdin.write(json.dumps(spec))
            p.stdin.close()
            procs.append(p)
        sent = [r for p in procs for r in json.loads(p.stdout.read())]
        errors = [r["error"] for r in sent if r["error"]]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
        arrive = {int(k): v for k, v in json.loads(server.stdout.readline()).items()}
    finally:
        server.kill()
        server.wait(5)
    send = {r["id"]: r["send"] for r in sent}
    after = [arrive[i] - send[i] for i in range(n)]
    return {"kind": kind, "arrive_p50_ms": 1e3 * pct(after, 50), "arrive_p99_ms": 1e3 * pct(after, 99),
            "last_after_first_send_ms": 1e3 * (max(arrive.values()) - min(send.values()))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="raw,bare,fastapi")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--http", default="h11", choices=["h11", "httptools"],
                    help="uvicorn's HTTP parser (httptools runs on uvloop; both must be importable)")
    ap.add_argument("--client", default="raw", choices=["raw", "httpx"],
                    help="raw: requests written by hand, encoded before the send (serve_burst_cpu.py); httpx: "
                         "as minikv.bench.serve and ratios_gpu.py send them")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # (one server, in its own process)
    args = ap.parse_args(argv)
    if args.serve:
        _serve(args.serve, args.requests, args.http)
        return 0
    prompts, _ = workload(args.requests, (100, 1024), (1, 2), 512)
    rows = []
    for r in range(args.rounds):
        for kind in args.kinds.split(","):
            row = {"round": r, **one_round(kind, prompts, args.clients, args.http, args.client)}
            rows.append(row)
            print(f"{kind:8s} arrive p50 {row['arrive_p50_ms']:6.1f} ms, p99 {row['arrive_p99_ms']:6.1f} ms, "
                  f"last {row['last_after_first_send_ms']:6.1f} ms after the first send", flush=True)
    if args.out:
        record = {"benchmark": "ingress_probe_cpu", "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                  "python": platform.python_version(), "requests": args.requests, "clients": args.clients,
                  "http": args.http, "client": args.client,
                  "load_average": os.getloadavg(), "rows": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
