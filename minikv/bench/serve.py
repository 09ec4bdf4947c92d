"""Online serving under load: a load generator against `minikv serve` (Poisson arrivals, streaming clients).

    minikv bench serve --url http://127.0.0.1:8000 --rate 2 --requests 40     against a running server
    minikv bench serve --model smollm2-135m --experiment all                  the recorded CPU run
    minikv bench serve --model random-qwen2.5-0.5b --device cuda --rates 4,16,64,128 --experiment sweep

Every request is streamed (`stream: true`), so the client sees each token when the server sends it:

    send ----- first token ---- token ---- token ----- ... ----- last token
    |<-- TTFT -->|<-- ITL -->|<-- ITL -->|                        e2e = send -> last token

Prompts are token ids (any model, no tokenizer needed), their lengths and the output lengths drawn
uniformly from seeded ranges, EOS ignored so each request produces exactly its output length.
Arrivals follow a Poisson process per tenant (exponential gaps at the tenant's rate), merged.

Reported per run: throughput (requests/s, output tokens/s), TTFT and ITL at p50/p90/p99, and
goodput: requests per second that met the latency target (TTFT <= --slo-ttft and mean ITL <=
--slo-itl), the measure DistServe (OSDI 2024) argues for, since a request served late is not served.

Experiments (--experiment; with --model, the bench starts and stops its own servers):
    sweep   rising rates on one server: where does latency break (continuous batching's knee)?
    noisy   the noisy neighbour: tenant A floods, tenant B sends short requests now and then; the same
            load against an FCFS server and a fair (VTC) server, B's p99 TTFT in each
    prefix  every request starts with the same system prompt: prefix caching on vs off (hit rate, TTFT)
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minikv.bench import REPO, environment


@dataclass
class TenantLoad:
    name: str
    rate: float  # requests per second
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


@dataclass
class Req:
    send_at: float
    tenant: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    tenant: str
    prompt_tokens: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    response_id: str | None = None  # the server's id of it (its trace's key: ttft_parts)
    sent_at: float | None = None  # time.perf_counter() when it was sent


def make_requests(loads: list[TenantLoad], seed: int, vocab: int, shared_prefix: list[int] | None = None) -> list[Req]:
    """Each tenant's requests at Poisson arrival times, merged in time order; seeded, so two runs
    (FCFS and fair, prefix caching on and off) replay the very same requests."""
    rng = random.Random(seed)
    reqs = []
    for load in loads:
        t = 0.0
        for _ in range(load.num_requests):
            t += rng.expovariate(load.rate)
            n = rng.randint(*load.prompt_len)
            prompt = [rng.randrange(3, min(vocab, 10000)) for _ in range(n)]
            reqs.append(Req(t, load.name, (shared_prefix or []) + prompt, rng.randint(*load.output_len)))
    return sorted(reqs, key=lambda r: r.send_at)


CLIENTS = ("httpx", "raw")  # run_load's clients: a library, or requests written by hand (see _one_raw)


def _body(model: str, req: Req) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},  # usage on a last chunk
            "return_token_ids": True}  # how many tokens each chunk carries (a server behind sends several)


def _read_line(res: Result, line: str, last: list[float]) -> None:
    """One line of a stream's server-sent events, taken into `res` (last: [when the previous chunk came])."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    chunk = json.loads(line[6:])
    if chunk.get("usage"):
        res.output_tokens = chunk["usage"]["completion_tokens"]
        res.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if not chunk.get("choices"):
        return
    now = time.perf_counter()
    k = len(chunk["choices"][0].get("token_ids") or []) or 1
    if res.ttft is None:
        res.ttft, res.response_id = now - res.sent_at, chunk.get("id")
        res.itls += [0.0] * (k - 1)
    else:  # k tokens came together: one gap, then k - 1 gaps of nothing (as the client saw them)
        res.itls += [now - last[0]] + [0.0] * (k - 1)
    last[0] = now


def _ended(res: Result, last: list[float]) -> None:
    res.e2e = last[0] - res.sent_at
    res.ok = res.output_tokens == res.max_tokens
    if not res.ok:
        res.error = f"got {res.output_tokens} of {res.max_tokens} tokens"


async def _one(http, url: str, model: str, req: Req, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.send_at - time.perf_counter()))
    res = Result(req.tenant, len(req.prompt), req.max_tokens)
    last = [time.perf_counter()]
    res.sent_at = last[0]
    try:
        async with http.stream("POST", url + "/v1/completions", json=_body(model, req),
                               headers={"Authorization": f"Bearer {req.tenant}"}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                _read_line(res, line, last)
        _ended(res, last)
    except Exception as e:  # noqa: BLE001  a failed request is a result too
        res.error = f"{type(e).__name__}: {e}"
    return res


def _raw_request(url: str, model: str, req: Req) -> bytes:
    """The whole HTTP/1.1 request, encoded before any clock starts (its own connection, closed after)."""
    host = url.removeprefix("http://")
    body = json.dumps(_body(model, req)).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {req.tenant}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


async def _body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]):
    """A response's body as it comes: chunked transfer encoding undone, or up to its length, or to the end."""
    if "chunked" in headers.get("transfer-encoding", ""):
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def _one_raw(url: str, req: Req, request: bytes, t0: float) -> Result:
    """One request written by hand on its own connection: none of a client library's CPU time in what it
    measures (on a host whose cores the clients share with the server, that time is the server's too)."""
    await asyncio.sleep(max(0.0, t0 + req.send_at - time.perf_counter()))
    res = Result(req.tenant, len(req.prompt), req.max_tokens)
    last = [time.perf_counter()]
    res.sent_at = last[0]
    host, _, port = url.removeprefix("http://").rpartition(":")
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        status = (await reader.readline()).split()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = _body_pieces(reader, headers)
        if len(status) < 2 or status[1] != b"200":
            text = b"".join([piece async for piece in body])
            res.error = f"HTTP {status[1].decode() if len(status) > 1 else '?'}: {text[:200]!r}"
            return res
        pending = b""
        async for piece in body:
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                _read_line(res, line.decode().rstrip("\r"), last)
        _ended(res, last)
    except Exception as e:  # noqa: BLE001  a failed request is a result too
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return res


async def _run(url: str, model: str, reqs: list[Req], ready=None, client: str = "httpx") -> tuple[list[Result], float]:
    if client == "raw":
        requests = [_raw_request(url, model, r) for r in reqs]
        if ready is not None:
            ready.wait()  # every client process starts its clock together
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one_raw(url, r, q, t0) for r, q in zip(reqs, requests)))
        return list(results), time.perf_counter() - t0
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        if ready is not None:
            ready.wait()  # every client process starts its clock together
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(http, url, model, r, t0) for r in reqs))
        return list(results), time.perf_counter() - t0


def _client_process(k: int, url: str, model: str, reqs: list[Req], ready, out, client: str) -> None:
    out.put((k, *asyncio.run(_run(url, model, reqs, ready, client))))


def run_load(url: str, model: str, reqs: list[Req], processes: int = 1,
             client: str = "httpx") -> tuple[list[Result], float]:
    """Send every request at its time (each its own streaming connection); wait for all of them.

    client: "httpx" (the library), or "raw": each request written by hand, encoded before the clock starts
    (its connection, parsing and body cost no library time; benchmarks/ingress_probe_cpu.py --client shows
    what the library takes from a burst's first arrivals).

    processes > 1 spreads the clients over that many processes (request i in process i % processes),
    all starting their clocks together: one Python process reading hundreds of streams is itself
    the bottleneck of a fast server, and would be measured instead of it. Results come back in the
    requests' order; the duration is the slowest process's."""
    if client not in CLIENTS:
        raise ValueError(f"client is {client!r}; one of {', '.join(CLIENTS)}")
    if processes <= 1:
        return asyncio.run(_run(url, model, reqs, client=client))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, out = ctx.Barrier(processes + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(k, url, model, reqs[k::processes], ready, out, client),
                         daemon=True) for k in range(processes)]
    for p in procs:
        p.start()
    ready.wait()
    results: list[Result] = [None] * len(reqs)  # type: ignore[list-item]
    duration = 0.0
    for _ in procs:
        k, share, seconds = out.get()
        results[k::processes] = share
        duration = max(duration, seconds)
    for p in procs:
        p.join()
    return results, duration


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


TTFT_PARTS = ("to_handler", "to_engine", "in_engine", "back", "to_client")


def ttft_parts(results: list[Result], trace: Path) -> dict[str, float | None]:
    """Where the first tokens of a load waited, the median of each part in seconds: the client's clock
    joined with the server's trace (MINIKV_SERVE_TRACE, minikv/serve/app.py) by response id; one clock
    for every process of the host (perf_counter: CLOCK_MONOTONIC on Linux).

        to_handler   sent -> its handler started     connect, the HTTP parse, the event loop's queue
        to_engine    handler -> the engine took it   body, checks, the pipe, the engine's current step
        in_engine    the engine's own TTFT           waiting for a seat, prefill
        back         first token -> first chunk sent the pipe back, the engine thread, the handler
        to_client    first chunk sent -> received    the socket and the client's own loop

    The parts of one request add up to its TTFT; `requests` is how many were joined. And the burst as the
    engine saw it: `first_arrival`, the first request's arrival in the engine after the first send, and
    `engine_p50`, the median first token after that arrival (offline's alike: `first_token_p50`)."""
    parts: dict[str, list[float]] = {k: [] for k in TTFT_PARTS}
    moments = first_token_moments(results, trace)
    for marks in moments.values():
        for k, a, b in zip(TTFT_PARTS, marks, marks[1:]):
            parts[k].append(b - a)
    sent, arrived, first = ([m[i] for m in moments.values()] for i in (0, 2, 3))
    burst = {"first_arrival": min(arrived) - min(sent), "engine_p50": pct(first, 50) - min(arrived)} if sent else {}
    return {**{k: pct(v, 50) for k, v in parts.items()}, "requests": len(sent), **burst}


def first_token_moments(results: list[Result], trace: Path) -> dict[str, list[float]]:
    """Each finished request the trace holds, by response id: its six moments on one clock, in the order of
    TTFT_PARTS's bounds (sent, handler, arrival in the engine, first token, first chunk sent, received)."""
    stamps = {}
    if trace.exists():
        for line in trace.read_text().splitlines():
            one = json.loads(line)
            stamps[one["id"]] = one
    moments = {}
    for r in results:
        t = stamps.get(r.response_id)
        if not r.ok or t is None or r.sent_at is None or t["first_sent"] is None:
            continue
        moments[r.response_id] = [r.sent_at, t["handler"], t["arrival"], t["first_token"], t["first_sent"],
                                  r.sent_at + r.ttft]
    return moments


def summarize(results: list[Result], duration: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [g for r in ok for g in r.itls]
    good = [r for r in ok if r.ttft <= slo_ttft and (not r.itls or float(np.mean(r.itls)) <= slo_itl)]
    out_tokens = sum(r.output_tokens for r in ok)
    s = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
         "errors": sorted({r.error for r in results if r.error})[:3], "duration_s": duration,
         "request_throughput": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
         "goodput_requests_per_s": len(good) / duration, "slo_attained": len(good) / len(results) if results else 0,
         "cached_tokens": sum(r.cached_tokens for r in ok), "prompt_tokens": sum(r.prompt_tokens for r in ok)}
    for name, vals in (("ttft", ttft), ("itl", itl), ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            s[f"{name}_p{q}_s"] = pct(vals, q)
    return s


def by_tenant(results: list[Result], duration: float, slo_ttft: float, slo_itl: float) -> dict:
    return {t: summarize([r for r in results if r.tenant == t], duration, slo_ttft, slo_itl)
            for t in sorted({r.tenant for r in results})}


# ---- servers this benchmark starts ------------------------------------------------------------------

class ServerProcess:
    """`minikv serve` in a process of its own (the clients' Python must not slow the engine's)."""

    def __init__(self, model: str, args: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "minikv.cli", "serve", "--model", model, "--port",
                                      str(self.port), "--log-level", "warning", *args],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); "
                                   f"its log: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout} s")

    def metrics(self) -> dict[str, float]:
        import httpx

        from minikv.serve.metrics import parse_metrics

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def served(model: str, common: list[str], extra: list[str], tmp: Path, tag: str) -> ServerProcess:
    return ServerProcess(model, common + extra, tmp / f"server_{tag}.log").wait_ready()


def warm_up(url: str, model: str, vocab: int) -> None:
    """A few requests first: the first steps of a fresh process pay for lazy initialisation."""
    run_load(url, model, make_requests([TenantLoad("warmup", 50.0, 4, (16, 64), (4, 8))], 99, vocab))


# ---- the experiments ------------------------------------------------------------------------------

def sweep(url: str, model: str, args, vocab: int) -> list[dict]:
    rows = []
    for rate in args.rates:
        reqs = sweep_requests(args, vocab, rate)
        results, duration = run_load(url, model, reqs, processes=args.client_processes)
        s = summarize(results, duration, args.slo_ttft, args.slo_itl)
        rows.append({"rate": rate, **s})
        print(f"[serve] rate {rate:6.2f} req/s: {s['output_tokens_per_s']:8.1f} tok/s, TTFT p50/p99 "
              f"{s['ttft_p50_s']:.3f}/{s['ttft_p99_s']:.3f} s, "
              f"ITL p50/p99 {s['itl_p50_s']:.3f}/{s['itl_p99_s']:.3f} s, "
              f"goodput {s['goodput_requests_per_s']:.2f} req/s ({s['slo_attained']:.0%} within SLO)", flush=True)
    return rows


def sweep_requests(args, vocab: int, rate: float) -> list[Req]:
    loads = [TenantLoad(f"tenant-{i}", rate / args.tenants, max(1, round(args.requests / args.tenants)),
                        args.prompt_len, args.output_len) for i in range(args.tenants)]
    return make_requests(loads, args.seed, vocab)


def compare_offline(model: str, args, vocab: int, rows: list[dict]) -> list[dict]:
    """Each rate's requests once more through `LLM(model).generate`, all at once, in this process
    (after the server has stopped: the card is the engine's alone); server / offline output tok/s."""
    from minikv import LLM, SamplingParams

    llm = LLM(model, device=args.device, kv_backend="paged")
    out = []
    try:
        llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=4, ignore_eos=True))  # lazy initialisation
        for row in rows:
            reqs = sweep_requests(args, vocab, row["rate"])
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
            t0 = time.perf_counter()
            done = llm.generate([r.prompt for r in reqs], params)
            seconds = time.perf_counter() - t0
            tok_s = sum(len(o.token_ids) for o in done) / seconds
            ratio = row["output_tokens_per_s"] / tok_s
            out.append({"rate": row["rate"], "offline_tokens_per_s": tok_s, "server_over_offline": ratio})
            print(f"[serve] rate {row['rate']:6.2f} req/s: server {row['output_tokens_per_s']:8.1f} tok/s, offline "
                  f"{tok_s:8.1f} tok/s (the same requests at once): server / offline {ratio:.2f}", flush=True)
    finally:
        llm.close()
    return out


def noisy_loads(args) -> list[TenantLoad]:
    a = TenantLoad("A-flood", args.flood_rate, args.flood_requests, args.prompt_len, args.output_len)
    duration = args.flood_requests / args.flood_rate
    b_n = max(4, round(duration * args.quiet_rate))
    return [a, TenantLoad("B-quiet", args.quiet_rate, b_n, (args.prompt_len[0], args.prompt_len[0]), (4, 8))]


def noisy(model: str, common: list[str], args, vocab: int, tmp: Path) -> dict:
    reqs = make_requests(noisy_loads(args), args.seed, vocab)
    out = {}
    for policy in ("fcfs", "vtc"):
        srv = served(model, common, ["--schedule-policy", policy], tmp, f"noisy_{policy}")
        try:
            warm_up(srv.url, model, vocab)
            results, duration = run_load(srv.url, model, reqs)
        finally:
            srv.stop()
        out[policy] = by_tenant(results, duration, args.slo_ttft, args.slo_itl)
        b, a = out[policy]["B-quiet"], out[policy]["A-flood"]
        print(f"[serve] noisy neighbour, {policy}: B TTFT p50/p99 {b['ttft_p50_s']:.3f}/{b['ttft_p99_s']:.3f} s; "
              f"A {a['output_tokens_per_s']:.1f} tok/s, TTFT p99 {a['ttft_p99_s']:.3f} s", flush=True)
    return out


def prefix(model: str, common: list[str], args, vocab: int, tmp: Path) -> dict:
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(3, min(vocab, 10000)) for _ in range(args.system_len)]
    loads = [TenantLoad(f"tenant-{i}", args.prefix_rate / args.tenants, max(1, args.prefix_requests // args.tenants),
                        (16, 48), args.output_len) for i in range(args.tenants)]
    reqs = make_requests(loads, args.seed, vocab, shared_prefix=system)
    out = {}
    for mode in ("none", "hash"):
        srv = served(model, [a for a in common if a != "--isolate-tenants"], ["--prefix-caching", mode], tmp,
                     f"prefix_{mode}")
        try:
            warm_up(srv.url, model, vocab)
            before = srv.metrics()
            results, duration = run_load(srv.url, model, reqs)
            after = srv.metrics()
        finally:
            srv.stop()
        q = after["minikv:prefix_cache_queries_total"] - before["minikv:prefix_cache_queries_total"]
        h = after["minikv:prefix_cache_hits_total"] - before["minikv:prefix_cache_hits_total"]
        out[mode] = {**summarize(results, duration, args.slo_ttft, args.slo_itl), "hit_rate": h / q if q else 0.0}
        s = out[mode]
        print(f"[serve] shared {args.system_len}-token system prompt, prefix caching {mode}: hit rate "
              f"{s['hit_rate']:.0%}, TTFT p50/p99 {s['ttft_p50_s']:.3f}/{s['ttft_p99_s']:.3f} s, "
              f"{s['output_tokens_per_s']:.1f} tok/s", flush=True)
    return out


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minikv bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (else --model starts servers)")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the model to serve: smollm2-135m, tiny-random, random-qwen2.5-0.5b, a checkpoint")
    ap.add_argument("--served-name", default=None, help="the `model` field to send (default: --model)")
    ap.add_argument("--experiment", choices=("sweep", "noisy", "prefix", "all"), default="sweep")
    ap.add_argument("--device", default=None)
    ap.add_argument("--server-args", default="", help="more `minikv serve` options, e.g. '--max-num-seqs 16'")
    ap.add_argument("--rates", default="1,2,4", type=lambda s: [float(x) for x in s.split(",")],
                    help="sweep: total request rates (req/s)")
    ap.add_argument("--requests", type=int, default=24, help="sweep: requests per rate")
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--prompt-len", type=_pair, default=(32, 256), help="lo,hi prompt tokens (uniform)")
    ap.add_argument("--output-len", type=_pair, default=(16, 64), help="lo,hi output tokens (uniform)")
    ap.add_argument("--flood-rate", type=float, default=4.0, help="noisy: tenant A's rate")
    ap.add_argument("--flood-requests", type=int, default=40)
    ap.add_argument("--quiet-rate", type=float, default=0.5, help="noisy: tenant B's rate")
    ap.add_argument("--system-len", type=int, default=512, help="prefix: tokens of the shared system prompt")
    ap.add_argument("--prefix-rate", type=float, default=2.0)
    ap.add_argument("--prefix-requests", type=int, default=24)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT target (s)")
    ap.add_argument("--slo-itl", type=float, default=0.25, help="goodput: mean ITL target (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON record here (and a line in RESULTS.md beside it)")
    ap.add_argument("--compare-offline", action="store_true",
                    help="sweep: run each rate's requests offline too (LLM.generate, in this process, after the "
                         "server stops) and print server / offline output tok/s")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="spread the sweep's clients over this many processes (one Python process reading "
                         "hundreds of streams is itself a bottleneck)")
    args = ap.parse_args(argv)
    if args.client_processes < 1:
        ap.error(f"--client-processes must be at least 1, got {args.client_processes}")

    tmp = Path(tempfile.mkdtemp(prefix="minikv-bench-serve-"))
    model, vocab = args.model, 10000
    if model == "random-qwen2.5-0.5b":
        from minikv.bench.throughput import QWEN25_05B_SHAPE, make_random_checkpoint

        model = str(make_random_checkpoint(QWEN25_05B_SHAPE, tmp / "qwen2.5-0.5b-random"))
    elif model == "tiny-random":
        vocab = 512
    name = args.served_name or model
    common = args.server_args.split() + (["--device", args.device] if args.device else [])
    if name != model:
        common += ["--served-model-name", name]
    record = {"date": datetime.date.today().isoformat(), **environment(args.device or "cpu"),
              "load_average_1min_before": os.getloadavg()[0], "model": args.model,
              "settings": {k: v for k, v in vars(args).items() if k not in ("out",)}}
    experiments = ("sweep", "noisy", "prefix") if args.experiment == "all" else (args.experiment,)
    if args.url is None:
        if "sweep" in experiments:
            srv = served(model, common, [], tmp, "sweep")
            try:
                warm_up(srv.url, name, vocab)
                record["sweep"] = sweep(srv.url, name, args, vocab)
                record["sweep_server_metrics"] = {k: v for k, v in srv.metrics().items()
                                                  if "bucket" not in k}
            finally:
                srv.stop()
            if args.compare_offline:
                record["compare_offline"] = compare_offline(model, args, vocab, record["sweep"])
        if "noisy" in experiments:
            record["noisy"] = {"loads": [asdict(x) for x in noisy_loads(args)],
                               **noisy(model, common, args, vocab, tmp)}
        if "prefix" in experiments:
            record["prefix"] = prefix(model, common, args, vocab, tmp)
    else:
        if experiments != ("sweep",):
            ap.error("--url runs the sweep against that server; noisy and prefix start their own servers (--model)")
        record["sweep"] = sweep(args.url, name, args, vocab)
        if args.compare_offline:
            ap.error("--compare-offline builds the engine in this process; use --model (no --url): the card must "
                     "be free of the server when the offline run starts")
    record["load_average_1min_after"] = os.getloadavg()[0]
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        with (out.parent / "RESULTS.md").open("a") as f:
            f.write(results_line(record, out.name))
        print(f"[serve] wrote {out} and a line in {out.parent / 'RESULTS.md'}")
    return 0


def results_line(rec: dict, json_name: str) -> str:
    parts = []
    if "sweep" in rec:
        parts.append("rates " + "; ".join(
            f"{r['rate']:g} req/s: {r['output_tokens_per_s']:.0f} tok/s, TTFT p50/p99 {r['ttft_p50_s']:.2f}/"
            f"{r['ttft_p99_s']:.2f} s, ITL p99 {r['itl_p99_s']:.3f} s, goodput {r['goodput_requests_per_s']:.2f} req/s"
            for r in rec["sweep"] if r["completed"]))
    if "noisy" in rec:
        n = rec["noisy"]
        parts.append(f"noisy neighbour (A floods, B short): B's p99 TTFT "
                     f"**FCFS {n['fcfs']['B-quiet']['ttft_p99_s']:.2f} s "
                     f"vs fair (VTC) {n['vtc']['B-quiet']['ttft_p99_s']:.2f} s**, A's throughput "
                     f"{n['fcfs']['A-flood']['output_tokens_per_s']:.0f} vs "
                     f"{n['vtc']['A-flood']['output_tokens_per_s']:.0f} tok/s"
                     f"; refused (429/503): A {n['fcfs']['A-flood']['failed']} vs {n['vtc']['A-flood']['failed']} of "
                     f"{n['fcfs']['A-flood']['requests']}, B {n['fcfs']['B-quiet']['failed']} vs "
                     f"{n['vtc']['B-quiet']['failed']} of {n['fcfs']['B-quiet']['requests']}")
    if "prefix" in rec:
        p = rec["prefix"]
        parts.append(f"shared {rec['settings']['system_len']}-token system prompt: TTFT p50 "
                     f"{p['none']['ttft_p50_s']:.2f} s without prefix caching, {p['hash']['ttft_p50_s']:.2f} s with "
                     f"(hit rate {p['hash']['hit_rate']:.0%})")
    return (f"- {rec['date']} · serve (online, streaming clients, Poisson arrivals) · {rec['device']} · torch "
            f"{rec['torch']} · {rec['model']} · load average {rec['load_average_1min_before']:.1f} · "
            + " · ".join(parts) + f" · commit {rec['commit']} · [{json_name}]({json_name})\n")


if __name__ == "__main__":
    sys.exit(main())
