"""The server (rung 10): a real HTTP server on a free loopback port, driven by the official `openai`
client and by plain HTTP. tiny-random (with a byte tokenizer for the text and chat routes) keeps it fast.

No test depends on the machine's speed: where a state must last ("A's request still runs while B
arrives"), a Gate holds the engine thread at the end of a step until the test opens it, and the test
waits for states (polling the server's own counters), never for time to pass. The time limits below
only turn a hang into a failure."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
HANG_S = 120  # a limit that only turns a hang into a failure: no test waits for it to pass


def engine(**options) -> LLM:
    base = dict(kv_backend="paged", block_size=16, num_blocks=96, max_num_seqs=8, max_model_len=1024,
                prefix_caching="hash")
    return LLM(tiny_random_with_text(), **{**base, **options})


class Gate:
    """An engine observer: while closed, the engine thread waits at the end of each step until the test
    opens it. So the test, not the machine's speed, decides how long a request runs. It also records
    the size of every batch."""

    def __init__(self, closed: bool = False):
        self._open = threading.Event()
        if not closed:
            self._open.set()
        self.holding = threading.Event()  # set while the engine waits at the gate
        self.batch_sizes: list[int] = []

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def on_step(self, llm, batch, events):
        self.batch_sizes.append(len(batch.seqs))
        if self._open.is_set():
            return
        self.holding.set()
        try:
            if not self._open.wait(HANG_S):
                raise RuntimeError(f"the test never opened the gate ({HANG_S} s)")
        finally:
            self.holding.clear()


def wait_until(condition, what: str, timeout_s: float = HANG_S, poll_s: float = 0.002) -> None:
    """Poll for an observable state (of a server, a router, a prefill batcher); fail (never pass) on the
    hang limit. The other test modules import it from here."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s} s: {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def gated():
    gate = Gate()
    llm = engine(schedule_policy="vtc")
    llm.add_observer(gate)
    with Server(llm, served_name=MODEL, isolate_tenants=True) as s:
        yield s, gate


@pytest.fixture(scope="module")
def server(gated):
    return gated[0]


@pytest.fixture
def gate(gated):
    """The module server's gate, open again after the test whatever happens."""
    yield gated[1]
    gated[1].open()


@pytest.fixture(scope="module")
def reference(server):
    """The in-process engine on the same weights: what the server must answer, token for token."""
    return server.engine.llm.derive()


_clients: dict = {}
HTTP = httpx.Client(timeout=HANG_S)  # one connection pool for the plain-HTTP calls


def client(server, key: str = "alice") -> openai.OpenAI:
    """One client per (server, API key): building one loads TLS certificates, a good part of a second."""
    if (server.url, key) not in _clients:
        _clients[server.url, key] = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                                                  timeout=HANG_S)
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
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    want = reference.generate("the cache", SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ids == want.token_ids and "".join(ch["text"] for c in chunks for ch in c["choices"]) == want.text
    assert all("usage" not in c for c in chunks)  # only stream_options.include_usage asks for it
    # the openai client reads the same stream, chat included
    deltas = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in deltas if c.choices]
    assert len(pieces) >= 2


def test_the_trace_records_where_each_streamed_first_token_waited(tmp_path, monkeypatch):
    """MINIKV_SERVE_TRACE: one line per streamed request that ended, its moments in order on one clock (the
    handler, the engine's arrival and first token, the first chunk sent), joined to the client's by id;
    the parts of its TTFT (minikv.bench.serve.ttft_parts) add up to what the client saw."""
    from minikv.bench.serve import TTFT_PARTS, Result, ttft_parts

    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINIKV_SERVE_TRACE", str(trace))
    with Server(engine(), served_name=MODEL) as s:
        body = {"model": MODEL, "prompt": prompt_ids(3), "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        res = Result("t", 12, 5, sent_at=time.perf_counter())
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=HANG_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and res.ttft is None:
                    res.ttft, res.response_id = time.perf_counter() - res.sent_at, json.loads(line[6:])["id"]
        HTTP.post(s.url + "/v1/completions", json={**body, "stream": False})  # not streamed: no line
    (one,) = [json.loads(line) for line in trace.read_text().splitlines()]
    assert one["id"] == res.response_id
    assert res.sent_at < one["handler"] <= one["arrival"] <= one["first_token"] <= one["first_sent"] \
        < res.sent_at + res.ttft, one
    res.ok = True
    parts = ttft_parts([res], trace)
    assert parts["requests"] == 1 and all(parts[k] >= 0 for k in parts)
    assert sum(parts[k] for k in TTFT_PARTS) == pytest.approx(res.ttft)
    # one request: the burst's first arrival is its own, and the engine's median first token its own
    assert parts["first_arrival"] == pytest.approx(parts["to_handler"] + parts["to_engine"])
    assert parts["engine_p50"] == pytest.approx(parts["in_engine"])


def test_twenty_concurrent_clients_each_get_their_own_answer_batched_together(server, reference, gate):
    n = 20
    want = reference.generate([prompt_ids(i, 8 + i) for i in range(n)], SamplingParams(max_tokens=12, ignore_eos=True))
    extra = {"return_token_ids": True, "ignore_eos": True}

    async def ask(c: openai.AsyncOpenAI, i: int) -> list[int]:
        kw = dict(model=MODEL, prompt=prompt_ids(i, 8 + i), max_tokens=12, temperature=0, extra_body=extra)
        if i % 2:  # half wait for the whole answer, half stream it
            return (await c.completions.create(**kw)).choices[0].model_extra["token_ids"]
        return [t async for ch in await c.completions.create(stream=True, **kw) for c_ in ch.choices
                for t in c_.model_extra["token_ids"]]

    async def main() -> list:
        clients = [openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=f"tenant-{k}", max_retries=0,
                                      timeout=HANG_S) for k in range(4)]
        asks = [asyncio.create_task(ask(clients[i % 4], i)) for i in range(n)]
        # the engine runs the first arrivals' step and waits at the gate: the others all queue meanwhile
        await asyncio.to_thread(wait_until, lambda: gate.holding.is_set() and
                                server.engine.num_queued() + len(server.engine.llm.scheduler.running) == n,
                                "the engine holds a step while every request is in")
        gate.open()
        return await asyncio.gather(*asks)

    gate.close()
    sizes_before = len(gate.batch_sizes)
    got = asyncio.run(main())
    assert got == [w.token_ids for w in want]
    assert max(gate.batch_sizes[sizes_before:]) > 1  # they were batched together, not served one by one


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
    kw = ({"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes)
          else {"json": body})
    r = HTTP.post(f"{server.url}/v1/{route}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) >= {"message", "type", "param", "code"}
    ok = HTTP.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_generation_route_answers_json_and_names_the_wrong_method(server):
    """A whole completion is JSON; a GET on a generation route gets an OpenAI-shaped 405 that names it."""
    ok = HTTP.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert ok.headers["content-type"] == "application/json" and ok.json()["object"] == "text_completion"
    for route in ("completions", "chat/completions"):
        r = HTTP.get(f"{server.url}/v1/{route}")
        assert r.status_code == 405, r.text
        assert f"GET /v1/{route}" in r.json()["error"]["message"]


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(server).completions.create(model="gpt-9", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client(server).completions.create(model=MODEL, prompt=[1], max_tokens=-1)


def settled(server) -> dict[str, float]:
    """The metrics once nothing runs and no block is held."""
    wait_until(lambda: (lambda m: m["minikv:num_requests_running"] == 0 and m["minikv:kv_cache_usage_perc"] == 0)
               (metrics(server)), "no request runs and every block is back")
    return metrics(server)


def test_a_client_that_disconnects_has_its_request_aborted_and_its_blocks_freed(server, gate):
    before = metrics(server).get('minikv:request_success_total{finished_reason="abort"}', 0)
    tokens_before = metrics(server).get('minikv:generation_tokens_total{tenant="anonymous"}', 0)
    asked = server.engine.num_aborts_asked
    body = {"model": MODEL, "prompt": prompt_ids(5, 40), "max_tokens": 900, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                gate.close()  # the request cannot finish while its client goes away
                wait_until(gate.holding.is_set, "the engine holds the request's next step")
                held = metrics(server)["minikv:kv_cache_usage_perc"]  # its blocks, while it runs
                break
    # the connection is closed: the handler asks the engine to abort it; the step ends; it is gone
    wait_until(lambda: server.engine.num_aborts_asked > asked, "the server saw the client go")
    gate.open()
    m = settled(server)
    assert held > 0
    assert m['minikv:request_success_total{finished_reason="abort"}'] == before + 1
    assert m['minikv:generation_tokens_total{tenant="anonymous"}'] - tokens_before < 900  # it did not run to the end


def test_a_client_that_gives_up_on_a_whole_answer_has_its_request_aborted_too(server, gate):
    before = metrics(server).get('minikv:request_success_total{finished_reason="abort"}', 0)
    asked = server.engine.num_aborts_asked
    body = json.dumps({"model": MODEL, "prompt": prompt_ids(6, 40), "max_tokens": 900, "ignore_eos": True}).encode()
    gate.close()  # the answer cannot come before the client gives up
    with socket.create_connection((server.host, server.port)) as sock:  # not streamed: the client waits...
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: minikv\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(gate.holding.is_set, "the request runs")
    # ... then hangs up
    wait_until(lambda: server.engine.num_aborts_asked > asked, "the server saw the client go")
    gate.open()
    m = settled(server)
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
    before = parse_metrics(HTTP.get(server.url + "/metrics").text)
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
    carol = server.tenant_id("carol")  # a keyed hash of the API key: /metrics never shows a key
    assert "carol" not in text and carol.startswith("t-")
    assert m[f'minikv:generation_tokens_total{{tenant="{carol}"}}'] == 3
    assert m[f'minikv:prompt_tokens_total{{tenant="{carol}"}}'] == 3
    assert m[f'minikv:tenant_service_tokens{{tenant="{carol}"}}'] >= 3 + 2 * 3  # the fair scheduler's counter
    assert m['minikv:time_to_first_token_seconds_bucket{le="+Inf"}'] == m["minikv:time_to_first_token_seconds_count"]
    # the engine's own clock: 3 tokens took at least 3 steps, and the seconds inside them grew with them
    assert m["minikv:engine_steps_total"] - before["minikv:engine_steps_total"] >= 3
    assert m["minikv:engine_step_seconds_total"] > before["minikv:engine_step_seconds_total"]
    assert 0 <= m["minikv:engine_wait_seconds_total"] <= m["minikv:engine_step_seconds_total"]


def post_as(url: str, key: str, body: dict) -> httpx.Response:
    with httpx.Client(timeout=HANG_S) as http:
        return http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_overload_gets_429_for_the_flooding_tenant_and_503_for_all_instead_of_an_unbounded_queue():
    llm = engine(max_num_seqs=1)
    gate = Gate(closed=True)  # A's first request holds the one seat until the test opens the gate
    llm.add_observer(gate)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
    with Server(llm, served_name=MODEL, max_waiting=2, max_waiting_per_tenant=1) as s, ThreadPoolExecutor(3) as pool:
        def waiting(key: str | None = None) -> int:
            return s.engine.num_waiting(None if key is None else s.tenant_id(key))

        try:
            a1 = pool.submit(post_as, s.url, "A", body)
            wait_until(gate.holding.is_set, "A's first request runs (in the one seat)")
            a2 = pool.submit(post_as, s.url, "A", body)
            wait_until(lambda: waiting("A") == 1, "A's second request waits for the seat")
            too_many = post_as(s.url, "A", body)  # A already has 1 waiting: A is refused, not everyone
            b = pool.submit(post_as, s.url, "B", body)  # B may still queue: 2 waiting, the server's limit
            wait_until(lambda: waiting() == 2, "B's request waits too")
            full = post_as(s.url, "C", body)
        finally:
            gate.open()
        assert [f.result().status_code for f in (a1, a2, b)] == [200, 200, 200]
        assert too_many.status_code == 429 and too_many.headers["retry-after"] == "1"
        assert f"tenant {s.tenant_id('A')} already has 1 requests waiting" in too_many.json()["error"]["message"]
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "overloaded" in full.json()["error"]["message"]
        m = parse_metrics(httpx.get(s.url + "/metrics").text)
        assert m['minikv:requests_rejected_total{reason="overloaded"}'] == 1
        assert m['minikv:requests_rejected_total{reason="tenant_limit"}'] == 1


def test_requests_that_take_free_seats_do_not_count_as_waiting_for_the_tenant_limit():
    llm = engine(max_num_seqs=5)
    gate = Gate(closed=True)  # X holds one seat; 4 are free; nothing moves until the test opens the gate
    llm.add_observer(gate)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
    with Server(llm, served_name=MODEL, max_waiting_per_tenant=3) as s, ThreadPoolExecutor(8) as pool:
        try:
            x = pool.submit(post_as, s.url, "X", body)
            wait_until(gate.holding.is_set, "X's request runs")
            # 4 take the free seats at the next step, 3 more wait: the tenant's limit, not over it
            mine = [pool.submit(post_as, s.url, "T", body) for _ in range(7)]
            wait_until(lambda: s.engine.num_queued(s.tenant_id("T")) == 7, "T's 7 requests are queued")
            assert s.engine.num_waiting(s.tenant_id("T")) == 3
            over = post_as(s.url, "T", body)
        finally:
            gate.open()
        assert [f.result().status_code for f in [x, *mine]] == [200] * 8
        assert over.status_code == 429, over.text


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
        def up() -> bool:
            assert proc.poll() is None, f"minikv serve exited ({proc.returncode}): {proc.stdout.read()}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=HANG_S).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False

        wait_until(up, "minikv serve answers /health")
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": "tiny-random", "prompt": [1, 2, 3], "max_tokens": 2}, timeout=HANG_S).json()
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S)  # uvicorn shuts down, then re-raises the signal it caught
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
    assert all(len(r.itls) == r.max_tokens - 1 for r in results)  # one gap per token after the first
    assert s["goodput_requests_per_s"] == s["request_throughput"]  # a generous target: all met it
    assert s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_p99_s"]
    assert set(by_tenant(results, duration, 1.0, 1.0)) == {"A", "B"}


def test_the_hand_written_client_reads_what_the_library_reads(server):
    """run_load(client="raw"): requests written by hand, the chunked stream undone by hand; every request's
    tokens, chunk gaps and response id as the httpx client gets them, and a refused request's error alike."""
    from minikv.bench.serve import Req, TenantLoad, make_requests, run_load

    reqs = make_requests([TenantLoad("A", 40.0, 6, (8, 40), (2, 9))], seed=11, vocab=512)
    by = {c: run_load(server.url, MODEL, reqs, client=c)[0] for c in ("httpx", "raw")}
    for ours, lib in zip(by["raw"], by["httpx"]):
        assert ours.ok and lib.ok and ours.error == lib.error == "", (ours, lib)
        assert ours.output_tokens == lib.output_tokens == ours.max_tokens
        assert len(ours.itls) == len(lib.itls) == ours.max_tokens - 1
        assert ours.response_id.startswith("cmpl-") and ours.response_id != lib.response_id
        assert 0 < ours.ttft <= ours.e2e and ours.sent_at is not None
    wrong = [Req(0.0, "A", [5, 6, 7], 2)]
    refused = {c: run_load(server.url, "no-such-model", wrong, client=c)[0][0] for c in ("httpx", "raw")}
    assert refused["raw"].error.startswith("HTTP 404: ") and refused["httpx"].error.startswith("HTTP 404: ")
    assert "no-such-model" in refused["raw"].error and not refused["raw"].ok
    with pytest.raises(ValueError, match="client is 'curl'"):
        run_load(server.url, MODEL, wrong, client="curl")


@pytest.mark.slow  # two spawned client processes import minikv
def test_the_load_spread_over_client_processes_returns_every_result_in_the_requests_order(server):
    from minikv.bench.serve import TenantLoad, make_requests, run_load

    reqs = make_requests([TenantLoad("A", 40.0, 5, (8, 24), (2, 6))], seed=5, vocab=512)
    for client in ("httpx", "raw"):
        results, duration = run_load(server.url, MODEL, reqs, processes=2, client=client)
        assert [r.max_tokens for r in results] == [q.max_tokens for q in reqs]
        assert all(r.ok and r.output_tokens == r.max_tokens for r in results) and duration > 0


@pytest.mark.slow  # a server process (and its engine process), then the offline engine
def test_bench_serve_compare_offline_runs_the_same_requests_offline_and_prints_the_ratio(tmp_path, capsys):
    from minikv.bench.serve import main

    out = tmp_path / "serve.json"
    assert main(["--model", "tiny-random", "--rates", "8", "--requests", "4", "--tenants", "2", "--output-len",
                 "4,8", "--prompt-len", "8,16", "--compare-offline", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (row,) = record["compare_offline"]
    assert row["rate"] == 8 and row["offline_tokens_per_s"] > 0 and row["server_over_offline"] > 0
    assert "server / offline" in capsys.readouterr().out


def test_a_stopped_server_keeps_no_engine_alive():
    """FastAPI caches route functions in module-level caches: the routes reach the engine through one
    holder that stop() empties, so the engine (and its pool) go with the last reference to them."""
    import gc
    import weakref

    def serve_once():
        llm = engine()
        server = Server(llm).start()
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3},
                       timeout=HANG_S)  # text: tokenized on the tokenizing threads
        assert r.status_code == 200
        threads = list(server.app.state.deps.tokenizer_pool._threads)  # this server's tokenizing threads
        server.stop()
        return weakref.ref(llm), weakref.ref(llm.core.pool), threads

    llm, pool, threads = serve_once()
    gc.collect()
    assert llm() is None and pool() is None, "a stopped server kept its engine alive"
    assert threads and not any(t.is_alive() for t in threads), "a stopped server left its tokenizing threads"


def test_the_generation_routes_are_served_in_front_of_the_framework_and_the_rest_by_it(server):
    """POST /v1/completions and /v1/chat/completions go straight to their handler (GenerationRoutes: plain
    ASGI, in front of FastAPI's routing); another method on the same path, or another path, is FastAPI's."""
    from minikv.serve.app import GenerationRoutes

    app = server.app
    assert any(m.cls is GenerationRoutes for m in app.user_middleware)
    got = HTTP.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt_ids(2), "max_tokens": 2})
    assert got.status_code == 200 and got.json()["object"] == "text_completion"
    bad = HTTP.post(server.url + "/v1/completions", content=b"{not json")  # the handler's own 400, JSON-shaped
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert HTTP.get(server.url + "/v1/completions").status_code == 405  # the framework's answer
    assert HTTP.post(server.url + "/v1/completion").status_code == 404
