"""The server (rung 10): a real HTTP server on a free loopback port, driven by the official `openai`
client and by plain HTTP. tiny-random (with a byte tokenizer for the text and chat routes) keeps it fast."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from minikv import LLM, SamplingParams
from minikv.serve import Server, parse_metrics
from minikv.serve.tiny import tiny_random_with_text

MODEL = "tiny-random"
ROOT = Path(__file__).resolve().parents[1]


def engine(**options) -> LLM:
    base = dict(kv_backend="paged", block_size=16, num_blocks=96, max_num_seqs=8, max_model_len=1024,
                prefix_caching="hash")
    return LLM(tiny_random_with_text(), **{**base, **options})


@pytest.fixture(scope="module")
def server():
    with Server(engine(schedule_policy="vtc"), served_name=MODEL, isolate_tenants=True) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    """The in-process engine on the same weights: what the server must answer, token for token."""
    return server.engine.llm.derive()


_clients: dict = {}
HTTP = httpx.Client(timeout=30)  # one connection pool for the plain-HTTP calls


def client(server, key: str = "alice") -> openai.OpenAI:
    """One client per (server, API key): building one loads TLS certificates, a good part of a second."""
    if (server.url, key) not in _clients:
        _clients[server.url, key] = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)
    return _clients[server.url, key]


def metrics(server) -> dict[str, float]:
    return parse_metrics(HTTP.get(server.url + "/metrics").text)


def prompt_ids(i: int, length: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 3 for j in range(length)]


def test_openai_client_gets_the_same_tokens_as_the_engine_in_process(server, reference):
    ids = prompt_ids(1)
    got = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
    want = reference.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (12, 12, 24)
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_chat_goes_through_the_chat_template(server, reference):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    got = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, seed=3)
    text = reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = reference.generate(text, SamplingParams(max_tokens=8))[0]
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_stream_is_server_sent_events_that_join_to_the_whole_answer_and_end_with_done(server, reference):
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    want = reference.generate("the cache", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ids == want.token_ids and "".join(ch["text"] for c in chunks for ch in c["choices"]) == want.text
    assert chunks[-1]["usage"]["completion_tokens"] == 10  # usage in a streamed answer too
    # the openai client reads the same stream, chat included
    deltas = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in deltas if c.choices]
    assert len(pieces) >= 2


def test_sixteen_concurrent_clients_each_get_their_own_answer(server, reference):
    n = 20
    want = reference.generate([prompt_ids(i, 8 + i) for i in range(n)], SamplingParams(max_tokens=12, ignore_eos=True))
    extra = {"return_token_ids": True, "ignore_eos": True}
    running_seen = []

    async def ask(c: openai.AsyncOpenAI, i: int) -> list[int]:
        kw = dict(model=MODEL, prompt=prompt_ids(i, 8 + i), max_tokens=12, temperature=0, extra_body=extra)
        if i % 2:  # half wait for the whole answer, half stream it
            return (await c.completions.create(**kw)).choices[0].model_extra["token_ids"]
        return [t async for ch in await c.completions.create(stream=True, **kw) for c_ in ch.choices
                for t in c_.model_extra["token_ids"]]

    async def watch(http: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            running_seen.append(parse_metrics((await http.get(server.url + "/metrics")).text)
                                ["minikv:num_requests_running"])
            await asyncio.sleep(0.01)

    async def main() -> list:
        clients = [openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=f"tenant-{k}", max_retries=0)
                   for k in range(4)]
        done = asyncio.Event()
        async with httpx.AsyncClient() as http:
            watcher = asyncio.create_task(watch(http, done))
            got = await asyncio.gather(*(ask(clients[i % 4], i) for i in range(n)))
            done.set()
            await watcher
        return got

    got = asyncio.run(main())
    assert got == [w.token_ids for w in want]
    assert max(running_seen) > 1  # they were batched together, not served one by one


BAD_REQUESTS = [  # (what, route, raw body, status, words the message must contain)
    ("malformed JSON", "completions", b'{"model": "tiny-random", "prompt": [1, 2', 400, "not valid JSON"),
    ("body not an object", "completions", b'[1, 2, 3]', 400, "JSON object"),
    ("missing prompt", "completions", {"model": MODEL, "max_tokens": 4}, 400, "'prompt' is required"),
    ("missing messages", "chat/completions", {"model": MODEL}, 400, "'messages' is required"),
    ("missing model", "completions", {"prompt": [1, 2]}, 400, "'model' is required"),
    ("wrong type", "completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": "ten"}, 400,
     "'max_tokens' must be an integer"),
    ("wrong type in prompt", "completions", {"model": MODEL, "prompt": [1, 2.5]}, 400, "'prompt' must be"),
    ("negative max_tokens", "completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": -3}, 400,
     "at least 1"),
    ("max_tokens over the context", "completions", {"model": MODEL, "prompt": [1], "max_tokens": 5000}, 400,
     "context is 1,024"),
    ("prompt over the limit", "completions", {"model": MODEL, "prompt": [5] * 1100, "max_tokens": 1}, 400,
     "max_model_len"),
    ("token outside the vocabulary", "completions", {"model": MODEL, "prompt": [1, 9999]}, 400, "vocabulary"),
    ("temperature out of range", "completions", {"model": MODEL, "prompt": [1], "temperature": 7}, 400,
     "temperature"),
    ("bad role", "chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("unsupported field", "completions", {"model": MODEL, "prompt": [1], "logprobs": 3}, 400, "not supported"),
    ("unknown model", "completions", {"model": "gpt-9", "prompt": [1, 2]}, 404, "does not exist"),
    ("unknown route", "embeddings", {"model": MODEL, "input": "x"}, 404, "routes"),
]


@pytest.mark.parametrize("what, route, body, status, words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_gets_an_openai_shaped_error_and_the_server_serves_on(server, what, route, body, status, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = HTTP.post(f"{server.url}/v1/{route}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) >= {"message", "type", "param", "code"}
    ok = HTTP.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="gpt-9", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client(server).completions.create(model=MODEL, prompt=[1], max_tokens=-1)


def test_a_client_that_disconnects_has_its_request_aborted_and_its_blocks_freed(server):
    before = metrics(server).get('minikv:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": prompt_ids(5, 40), "max_tokens": 900, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                held = metrics(server)["minikv:kv_cache_usage_perc"]  # its blocks, while it runs
                break
    # the connection is closed: within a few steps the request is gone and its blocks are back
    deadline = time.time() + 10
    while time.time() < deadline:
        m = metrics(server)
        if m["minikv:num_requests_running"] == 0 and m["minikv:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.02)
    assert held > 0 and m["minikv:kv_cache_usage_perc"] == 0 and m["minikv:num_requests_running"] == 0
    assert m['minikv:request_success_total{finished_reason="abort"}'] == before + 1
    assert m['minikv:generation_tokens_total{tenant="anonymous"}'] < 900  # it did not run to the end


def test_a_client_that_gives_up_on_a_whole_answer_has_its_request_aborted_too(server):
    before = metrics(server).get('minikv:request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": prompt_ids(6, 40), "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):  # not streamed: the client waits, then hangs up
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.time() + 10
    while time.time() < deadline and metrics(server)["minikv:num_requests_running"] > 0:
        time.sleep(0.02)
    m = metrics(server)
    assert m["minikv:kv_cache_usage_perc"] == 0
    assert m['minikv:request_success_total{finished_reason="abort"}'] == before + 1


def test_isolated_tenants_never_share_cached_blocks(server):
    shared = {"model": MODEL, "prompt": prompt_ids(9, 64), "max_tokens": 1, "temperature": 0}
    alice, bob = client(server, "alice"), client(server, "bob")
    alice.completions.create(**shared)
    again = alice.completions.create(**shared)
    other = bob.completions.create(**shared)
    assert again.usage.prompt_tokens_details.cached_tokens == 48  # 3 whole blocks of 16 (the last is partial)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # same prompt, another tenant: no hit


def test_metrics_use_vllm_names_and_count_per_tenant(server):
    client(server, "carol").completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=3, temperature=0,
                                               extra_body={"ignore_eos": True})
    text = HTTP.get(server.url + "/metrics").text
    m = parse_metrics(text)
    for name in ("minikv:kv_cache_usage_perc", "minikv:num_requests_running", "minikv:num_requests_waiting",
                 "minikv:num_preemptions_total", "minikv:prefix_cache_hit_rate", "minikv:prefix_cache_queries_total",
                 "minikv:prefix_cache_hits_total", "minikv:time_to_first_token_seconds_count",
                 "minikv:inter_token_latency_seconds_count"):
        assert name in m, name
    assert "# TYPE minikv:time_to_first_token_seconds histogram" in text
    assert m['minikv:generation_tokens_total{tenant="carol"}'] == 3
    assert m['minikv:prompt_tokens_total{tenant="carol"}'] == 3
    assert m['minikv:tenant_service_tokens{tenant="carol"}'] >= 3 + 2 * 3  # the fair scheduler's counter
    assert m['minikv:time_to_first_token_seconds_bucket{le="+Inf"}'] == m["minikv:time_to_first_token_seconds_count"]


class SlowSteps:
    """An observer that makes every engine step last at least `seconds`: a tiny model on an idle machine
    would otherwise finish a long answer before the test's next request arrives."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step(self, llm, batch, events):
        time.sleep(self.seconds)


def test_overload_gets_429_for_the_flooding_tenant_and_503_for_all_instead_of_an_unbounded_queue():
    llm = engine(max_num_seqs=1)
    llm.add_observer(SlowSteps(0.02))  # A's first answer takes 20 s or more: it runs while the others arrive
    with Server(llm, served_name=MODEL, max_waiting=2, max_waiting_per_tenant=1) as s:
        # long answers (the most max_model_len allows), so that A's first still runs while the others arrive
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
        with httpx.Client(timeout=30) as http:
            def post(key: str, stream: bool):
                kw = dict(json={**body, "stream": stream}, headers={"Authorization": f"Bearer {key}"})
                if not stream:
                    return http.post(s.url + "/v1/completions", **kw)
                st = http.stream("POST", s.url + "/v1/completions", **kw)
                st.__enter__()
                streams.append(st)
                return st

            streams = []
            post("A", True), post("A", True)  # A's first runs (one seat), its second waits
            too_many = post("A", False)  # A already has 1 waiting: A is refused, not everyone
            post("B", True)  # B may still queue: 2 waiting now, the server's limit
            full = post("C", False)
            for st in streams:
                st.__exit__(None, None, None)
        assert too_many.status_code == 429 and too_many.headers["retry-after"] == "1"
        assert "tenant 'A' already has 1 requests waiting" in too_many.json()["error"]["message"]
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "overloaded" in full.json()["error"]["message"]
        m = parse_metrics(httpx.get(s.url + "/metrics").text)
        assert m['minikv:requests_rejected_total{reason="overloaded"}'] == 1
        assert m['minikv:requests_rejected_total{reason="tenant_limit"}'] == 1


@pytest.mark.slow
def test_minikv_serve_starts_from_the_command_line_and_stops_on_sigterm():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "minikv.cli", "serve", "--model", "tiny-random", "--port", str(port),
                             "--num-blocks", "64", "--schedule-policy", "vtc", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 2}, timeout=10).json()
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)  # uvicorn shuts down, then re-raises the signal it caught
    out = proc.stdout.read()
    assert code in (0, -signal.SIGTERM) and "serving 'tiny-random'" in out and "Traceback" not in out


def test_bench_serve_replays_the_same_seeded_load_and_measures_every_request(server):
    from minikv.bench.serve import TenantLoad, by_tenant, make_requests, run_load, summarize

    loads = [TenantLoad("A", 40.0, 6, (8, 24), (4, 8)), TenantLoad("B", 20.0, 3, (8, 8), (2, 3))]
    reqs = make_requests(loads, seed=3, vocab=512)
    assert reqs == make_requests(loads, seed=3, vocab=512) != make_requests(loads, seed=4, vocab=512)
    assert [r.send_at for r in reqs] == sorted(r.send_at for r in reqs) and len(reqs) == 9
    gaps = np.diff([r.send_at for r in make_requests([TenantLoad("x", 50.0, 4000, (1, 1), (1, 1))], 0, 512)])
    assert abs(gaps.mean() - 1 / 50) < 0.002  # Poisson arrivals: exponential gaps of mean 1 / rate
    results, duration = run_load(server.url, MODEL, reqs)
    s = summarize(results, duration, slo_ttft=60.0, slo_itl=60.0)
    assert (s["completed"], s["failed"]) == (9, 0)
    assert sum(r.output_tokens for r in results) == sum(r.max_tokens for r in reqs)
    assert all(len(r.itls) == r.max_tokens - 1 for r in results)  # every token arrived as its own event
    assert s["goodput_requests_per_s"] == s["request_throughput"]  # a generous target: all met it
    assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
    assert set(by_tenant(results, duration, 1.0, 1.0)) == {"A", "B"}
