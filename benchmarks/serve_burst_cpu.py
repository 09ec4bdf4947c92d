"""Time to first token of a burst: N streaming clients arriving at once at `minikv serve` (the engine in
its own process) against offline `generate` on the same requests, in the same run, on the CPU.

    PYTHONPATH=. python benchmarks/serve_burst_cpu.py --out x.json        this tree, --rounds times
    PYTHONPATH=. python benchmarks/serve_burst_cpu.py --compare /tmp/base  this tree and another (`git archive
        <commit> | tar -x -C /tmp/base`), round by round, taking turns -> benchmarks/serve_burst_cpu.json
    ... --profile DIR      cProfile of the HTTP thread, the engine thread and the core process, top lines printed

On a shared machine the figures move with the load (each round records its own): compare trees on
the same machine in alternating rounds, by the server/offline ratio of each round (both measured in
that round) and by the server's own stages (send -> sent: admission), not by one round's seconds.

Where a request's first token spends its time, each stage measured in the process where it happens (one
clock: time.perf_counter is CLOCK_MONOTONIC in every process of a Linux machine):

    client send -> arrive (ASGI, before FastAPI) -> submit (parsed, tokenized, handed to the engine loop)
      -> sent (the engine thread puts it on the core's queue) -> core add (the core took it)
      -> core token (its first token sampled) -> server token (the engine thread hands it over)
      -> chunk (the first SSE body written) -> client (the first chunk read by the client)

The clients run in processes of their own and all send at one instant. The model is `tiny-random`
(with a byte tokenizer), small enough that the engine's compute does not hide the server's own costs:
what is measured is admission, not the model. Prompts are token ids.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STAGES = ["arrive", "submit", "sent", "core_add", "core_token", "server_token", "chunk", "client"]


def workload(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int):
    """nano-vllm's recipe (random.seed(0), lengths uniform), scaled to the CPU; EOS ignored."""
    random.seed(0)
    prompts = [[random.randint(3, vocab - 1) for _ in range(random.randint(*prompt_len))] for _ in range(n)]
    outputs = [random.randint(*output_len) for _ in range(n)]
    return prompts, outputs


def pct(xs, q) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


# ---- the client processes -------------------------------------------------------------------------

async def _client(url: str, jobs: list[dict], start_at: float) -> list[dict]:
    """Each job on its own connection, written by hand (HTTP/1.1, Connection: close): a client library's
    own CPU time would be counted in the TTFT, on a machine whose cores the server shares."""
    host, port = url.removeprefix("http://").split(":")
    requests = []
    for job in jobs:
        body = json.dumps({"model": "tiny", "prompt": job["prompt"], "max_tokens": job["max_tokens"],
                           "ignore_eos": True, "temperature": 0, "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nx-burst-id: {job['id']}\r\nConnection: close\r\n\r\n")
        requests.append(head.encode() + body)

    async def one(job: dict, request: bytes) -> dict:
        out = {"id": job["id"], "send": time.perf_counter(), "client": None, "chunks": 0, "error": None}
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            status = await reader.readline()
            if b" 200 " not in status:
                out["error"] = f"{status!r}: {(await reader.read())[-200:]!r}"
            while out["error"] is None:
                data = await reader.read(65536)
                if not data:
                    break
                if out["client"] is None and b"data: {" in data:
                    out["client"] = time.perf_counter()
                out["chunks"] += data.count(b"data: {")
            out["done"] = time.perf_counter()
            writer.close()
        except OSError as e:  # reported per request
            out["error"] = f"{type(e).__name__}: {e}"
        return out

    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    return await asyncio.gather(*(one(j, r) for j, r in zip(jobs, requests)))


def client_main() -> None:
    spec = json.load(sys.stdin)
    print(json.dumps(asyncio.run(_client(spec["url"], spec["jobs"], spec["start_at"]))))


# ---- the server side ------------------------------------------------------------------------------

class Stamps:
    """ASGI middleware: when each request (header x-burst-id) arrived, and when its first body chunk went."""

    def __init__(self, app, arrive: dict, chunk: dict):
        self.app, self.arrive, self.chunk = app, arrive, chunk

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        bid = next((int(v) for k, v in scope["headers"] if k == b"x-burst-id"), None)
        if bid is None:
            return await self.app(scope, receive, send)
        self.arrive[bid] = time.perf_counter()

        async def stamped(message):
            if message["type"] == "http.response.body" and message.get("body") and bid not in self.chunk:
                self.chunk[bid] = time.perf_counter()
            await send(message)
        await self.app(scope, receive, stamped)


def instrument(server, proc, prompts) -> dict[str, dict]:
    """Wrap the server's seams (instance attributes only) to stamp each stage; returns the stamps by id."""
    st = {k: {} for k in STAGES}
    by_prompt = {tuple(p): i for i, p in enumerate(prompts)}
    bid_of: dict[str, int] = {}
    server.app.add_middleware(Stamps, arrive=st["arrive"], chunk=st["chunk"])
    engine = server.engine
    submit, send, publish_one = engine.submit, proc.send, engine._publish_one

    def stamped_submit(prompt, params, tenant, rid, on_event):
        bid = by_prompt.get(tuple(prompt["prompt_token_ids"]))
        if bid is not None:
            bid_of[rid] = bid
            st["submit"][bid] = time.perf_counter()
        return submit(prompt, params, tenant, rid, on_event)

    def stamped_send(*command):
        if command[0] == "add" and command[1].request_id in bid_of:
            st["sent"][bid_of[command[1].request_id]] = time.perf_counter()
        return send(*command)

    def stamped_publish_one(rid, live, step):
        bid = bid_of.get(rid)
        if bid is not None:
            if bid not in st["server_token"] and any(ids for ids, _, _ in step.samples.values()):
                st["server_token"][bid] = time.perf_counter()
            if step.usage is not None:
                st["core_add"][bid] = step.usage.arrival_time
                st["core_token"][bid] = step.usage.token_times[0] if step.usage.token_times else None
        return publish_one(rid, live, step)

    engine.submit, proc.send, engine._publish_one = stamped_submit, stamped_send, stamped_publish_one
    if hasattr(proc, "send_many"):  # a server that hands the core its commands in batches
        send_many = proc.send_many

        def stamped_send_many(commands):
            t = time.perf_counter()
            for c in commands:
                if c[0] == "add" and c[1].request_id in bid_of:
                    st["sent"][bid_of[c[1].request_id]] = t
            return send_many(commands)
        proc.send_many = stamped_send_many
    return st


def profile_threads(server, directory: Path) -> list:
    """cProfile the HTTP thread (the event loop) and the engine thread; dumped when they end."""
    http, loop = cProfile.Profile(), cProfile.Profile()
    serve, run_loop = server._uvicorn.serve, server.engine._loop

    async def profiled_serve(*a, **k):
        http.enable()
        try:
            await serve(*a, **k)
        finally:
            http.disable()
            http.dump_stats(directory / "http.prof")

    def profiled_loop():
        try:
            loop.runcall(run_loop)
        finally:
            loop.dump_stats(directory / "engine_thread.prof")
    server._uvicorn.serve, server.engine._loop = profiled_serve, profiled_loop
    return [http, loop]


def top(path: Path, n: int = 18) -> str:
    out = io.StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def run_server(prompts, outputs, options, num_clients: int, profile: Path | None, model=None, warm: int = 0,
               stream_interval: int = 1) -> dict:
    """One burst through a server whose engine runs `model` (default: tiny-random) in its own process, after
    `warm` requests of 8 tokens each (one at a time: kernels compiled before the burst, as offline's)."""
    from minikv.serve import Server
    from minikv.serve.core_process import CoreProcess
    from minikv.serve.tiny import tiny_random_with_text

    if profile is not None:
        os.environ["MINIKV_CORE_PROFILE"] = str(profile / "core.prof")
    proc = CoreProcess(model if model is not None else tiny_random_with_text(), **options)
    os.environ.pop("MINIKV_CORE_PROFILE", None)
    interval = {"stream_interval": stream_interval} if stream_interval != 1 else {}  # (--compare: older trees lack it)
    server = Server(proc, served_name="tiny", max_waiting=100_000, **interval)
    st = instrument(server, proc, prompts)
    if profile is not None:
        profile_threads(server, profile)
    with server:
        if warm:
            import httpx

            for p in prompts[:warm]:  # reversed: never stamped as the burst's own (`instrument` finds them by prompt)
                httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": p[::-1], "max_tokens": 8,
                                                                 "ignore_eos": True, "temperature": 0},
                           timeout=300).raise_for_status()
        jobs = [{"id": i, "prompt": p, "max_tokens": m} for i, (p, m) in enumerate(zip(prompts, outputs))]
        start_at = time.perf_counter() + 3.0  # every client process connected and waiting by then
        clients = [subprocess.Popen([sys.executable, __file__, "--client"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in range(num_clients)]
        for k, c in enumerate(clients):
            c.stdin.write(json.dumps({"url": server.url, "jobs": jobs[k::num_clients], "start_at": start_at}))
            c.stdin.close()
        collected = []  # this process's garbage collections during the burst: (start, seconds, generation)

        def on_gc(phase, info, began=[0.0]):  # noqa: B006  (the start of the collection under way)
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                collected.append((began[0], time.perf_counter() - began[0], info["generation"]))
        heap = {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}  # before the burst
        spies = []
        if os.environ.get("SERVE_BURST_SPY"):  # py-spy samples whichever thread of this process holds the lock
            spies.append(spy(os.getpid(), os.environ["SERVE_BURST_SPY"], gil=True))
        if os.environ.get("SERVE_BURST_CORE_SPY"):  # and every sample of the engine process, busy or waiting
            spies.append(spy(proc.process.pid, os.environ["SERVE_BURST_CORE_SPY"]))
        gc.callbacks.append(on_gc)
        try:
            results = [r for c in clients for r in json.loads(c.stdout.read())]
            for c in clients:
                c.wait()
        finally:
            gc.callbacks.remove(on_gc)
        for one in spies:
            one.wait()
    results.sort(key=lambda r: r["id"])
    errors = [r["error"] for r in results if r["error"]]
    rows = []
    for r in results:
        row = {"send": r["send"], "client": r["client"]}
        row.update({k: st[k].get(r["id"]) for k in STAGES if k != "client"})
        rows.append(row)
    stages = {}
    for k in STAGES:  # each stage, seconds after the client sent
        stages[k] = {"p50": pct([row[k] - row["send"] if row[k] else None for row in rows], 50),
                     "p99": pct([row[k] - row["send"] if row[k] else None for row in rows], 99)}
    ttft = [r["client"] - r["send"] for r in results if r["client"]]
    first_send = min(r["send"] for r in results)
    if os.environ.get("SERVE_BURST_ROWS"):  # every request's stamps, for a closer look
        Path(os.environ["SERVE_BURST_ROWS"]).write_text(json.dumps(rows))
    done = [r.get("done") for r in results if r.get("done")]
    burst = [(t - first_send, s, g) for t, s, g in collected if t >= first_send - 0.5]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "errors": len(errors),
            "seconds": max(done) - first_send if done else None, "chunks": sum(r["chunks"] for r in results),
            "error_sample": errors[:3], "stages_after_send_s": stages,
            "send_spread_s": max(r["send"] for r in results) - first_send,
            "gc_during_burst": {"heap_before": heap, "collections": len(burst), "seconds": sum(s for _, s, _ in burst),
                                "full": [(round(t, 4), round(s, 4)) for t, s, g in burst if g == 2]},
            "last_arrival_after_first_send_s": max(v for v in st["arrive"].values()) - first_send
            if st["arrive"] else None}


def spy(pid: int, out: str, gil: bool = False, seconds: int = 5) -> subprocess.Popen:
    """py-spy (on PATH) recording process `pid` for `seconds`, 1,000 samples a second, into `out` (raw folded
    stacks, by thread: benchmarks/spy_summary.py reads them). gil: only the thread holding the interpreter
    lock; otherwise every thread's samples, including those waiting. Nonblocking: the process never stops."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), *(["--gil"] if gil else ["--idle"]), "--threads",
                             "--nonblocking", "--format", "raw", "-r", "1000", "-d", str(seconds), "-o", out],
                            stdout=subprocess.DEVNULL)


def run_offline(prompts, outputs, options, model=None) -> dict:
    from minikv import LLM, SamplingParams
    from minikv.serve.tiny import tiny_random_with_text

    with LLM(model if model is not None else tiny_random_with_text(), **options) as llm:
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in outputs]
        llm.generate(prompts[:8], params[:8])  # warm
        recording = spy(os.getpid(), os.environ["SERVE_BURST_OFFLINE_SPY"]) if os.environ.get(
            "SERVE_BURST_OFFLINE_SPY") else None  # the same burst offline: this process's samples
        res = llm.generate(prompts, params)
        if recording is not None:  # (py-spy writes nothing if stopped early: past the burst it samples this wait)
            recording.wait()
    ttft = [r.time_to_first_token for r in res]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", default="16,128")
    ap.add_argument("--output-len", default="16,64")
    ap.add_argument("--clients", type=int, default=2, help="client processes the requests are spread over")
    ap.add_argument("--rounds", type=int, default=2, help="server runs (each a fresh engine process)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("serve_burst_cpu.json")))
    ap.add_argument("--label", default="")
    ap.add_argument("--profile", default=None, help="a directory for cProfile files (the figures then mean little)")
    ap.add_argument("--compare", default=None, help="the root of another tree: both measured, taking turns")
    ap.add_argument("--stream-interval", type=int, default=1, help="the server's stream_interval")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main()
    if args.compare:
        return compare(args)
    import minikv
    from minikv.bench import environment

    prompt_len = tuple(int(x) for x in args.prompt_len.split(","))
    output_len = tuple(int(x) for x in args.output_len.split(","))
    options = dict(kv_backend="paged", block_size=16, max_num_seqs=args.requests, max_model_len=2048,
                   max_num_batched_tokens=8192,
                   num_blocks=args.requests * -(-(prompt_len[1] + output_len[1]) // 16) + 64)
    prompts, outputs = workload(args.requests, prompt_len, output_len, vocab=512)
    profile = Path(args.profile) if args.profile else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    offline, served = [], []
    for _ in range(args.rounds):
        offline.append(run_offline(prompts, outputs, options))
        served.append(run_server(prompts, outputs, options, args.clients, profile,
                                 stream_interval=args.stream_interval))
        print(json.dumps({"offline": offline[-1], "server": served[-1]}, indent=1), flush=True)
    srv_p50 = float(np.median([s["ttft_p50_s"] for s in served]))
    off_p50 = float(np.median([o["ttft_p50_s"] for o in offline]))
    record = {
        "benchmark": "serve_burst_cpu", "label": args.label, "minikv": str(Path(minikv.__file__).parent),
        "environment": environment("cpu"), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "workload": {"requests": args.requests, "prompt_len": prompt_len, "output_len": output_len,
                     "prompt_ids": "uniform in [3, 511], random.seed(0)", "model": "tiny-random (byte tokenizer)",
                     "greedy": True, "ignore_eos": True, "client_processes": args.clients, "options": options},
        "offline": offline, "server": served,
        "ttft_p50_server_over_offline": srv_p50 / off_p50,
    }
    print(f"TTFT p50: server {srv_p50:.3f} s, offline {off_p50:.3f} s: {srv_p50 / off_p50:.2f}x; "
          f"load average {os.getloadavg()[0]:.1f}")
    if profile is not None:
        for name in ("http.prof", "engine_thread.prof", "core.prof"):
            if (profile / name).exists():
                print(f"==== {name}\n{top(profile / name)}")
        return
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.out)


def summary(rounds: list[dict]) -> dict:
    """The medians over rounds of what one round compares: server/offline TTFT p50, and the server's stages."""
    def med(xs):
        return float(np.median(xs))
    stages = {k: med([r["server"][0]["stages_after_send_s"][k]["p50"] for r in rounds]) for k in STAGES}
    return {"ttft_p50_server_over_offline_median": med([r["ttft_p50_server_over_offline"] for r in rounds]),
            "server_ttft_p50_median_s": med([r["server"][0]["ttft_p50_s"] for r in rounds]),
            "server_ttft_p99_median_s": med([r["server"][0]["ttft_p99_s"] for r in rounds]),
            "offline_ttft_p50_median_s": med([r["offline"][0]["ttft_p50_s"] for r in rounds]),
            "stages_p50_median_s": stages}


def compare(args) -> None:
    """This tree ("after") and another ("before"), one round each in turn (the order swapped every round),
    each round in a fresh process importing its tree."""
    from minikv.bench import environment

    here = Path(__file__).resolve().parents[1]
    trees = {"after": here, "before": Path(args.compare).resolve()}
    rounds: dict[str, list[dict]] = {k: [] for k in trees}
    flags = ["--requests", str(args.requests), "--prompt-len", args.prompt_len, "--output-len", args.output_len,
             "--clients", str(args.clients), "--rounds", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
                out = Path(tmp) / f"{name}{i}.json"
                env = {**os.environ, "PYTHONPATH": str(trees[name])}
                subprocess.run([sys.executable, __file__, *flags, "--label", name, "--out", str(out)], env=env,
                               check=True, stdout=subprocess.DEVNULL)
                rounds[name].append(json.loads(out.read_text()))
                r = rounds[name][-1]
                print(f"round {i} {name}: server {r['server'][0]['ttft_p50_s']:.3f} s, offline "
                      f"{r['offline'][0]['ttft_p50_s']:.3f} s ({r['ttft_p50_server_over_offline']:.2f}x), "
                      f"load {r['load_average_before'][0]:.1f}", flush=True)
    record = {"benchmark": "serve_burst_cpu", "environment": environment("cpu"),
              "workload": rounds["after"][0]["workload"], "label": args.label,
              "trees": {k: str(v) for k, v in trees.items()},
              "summary": {k: summary(v) for k, v in rounds.items()}, "rounds": rounds}
    for k, v in record["summary"].items():
        print(k, json.dumps(v))
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
