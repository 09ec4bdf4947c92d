"""The router (rung 13): one OpenAI-compatible front over several replicas.

The policies are pure functions, pinned on scripted traces without any server. The HTTP tests run two
in-process replicas of tiny-random (one set of weights) behind a router on a thread; the replica that
dies is a real process, killed. No test waits for time to pass: states are reached by events (the
router's own counters), and the time limits only turn a hang into a failure."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from minikv import LLM, SamplingParams
from minikv.serve import Server, parse_metrics
from minikv.serve.router import (
    PrefixTable,
    ReplicaState,
    Router,
    RouterState,
    block_hashes,
    cache_aware,
    least_loaded,
    round_robin,
)
from minikv.serve.tiny import tiny_random_with_text

from test_serve import wait_until  # noqa: E402  (tests/ is on the path)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = "tiny-random"
ROOT = Path(__file__).resolve().parents[1]
HANG_S = 120




# ---- the policies, on scripted traces ---------------------------------------------------------------

def states(*rows: tuple) -> list[ReplicaState]:
    """rows of (up, load, matched, cached)."""
    return [ReplicaState(*row) for row in rows]


def test_round_robin_takes_the_replicas_that_are_up_in_turn():
    reps = states((True, 9, 5, 5), (False, 0, 0, 0), (True, 0, 0, 0))
    assert [round_robin(reps, 5, t) for t in range(4)] == [0, 2, 0, 2]


def test_least_loaded_takes_the_fewest_in_flight_and_shares_ties_in_turn():
    reps = states((True, 3, 9, 9), (True, 1, 0, 0), (True, 1, 0, 0), (False, 0, 0, 0))
    assert [least_loaded(reps, 9, t) for t in range(3)] == [1, 2, 1]


def test_cache_aware_takes_the_longest_match_unless_its_load_is_over_the_threshold():
    reps = states((True, 2, 1, 10), (True, 3, 7, 10), (True, 0, 0, 10))
    assert cache_aware(reps, 8, 0, balance_threshold=4) == 1  # 3 in flight, 3 beyond the least: match wins
    assert cache_aware(reps, 8, 0, balance_threshold=2) == 2  # 3 beyond is over 2: balance wins
    assert cache_aware(reps, 20, 0, balance_threshold=4) == 2  # 7 of 20 blocks is too little to count
    busy = states((True, 6, 7, 10), (True, 1, 0, 10))
    assert cache_aware(busy, 8, 0, balance_threshold=4) == 1


def test_cache_aware_sends_a_prefix_seen_nowhere_to_the_least_loaded_and_emptiest_cache():
    reps = states((True, 0, 0, 30), (True, 0, 0, 10), (True, 1, 0, 0))
    assert [cache_aware(reps, 4, t) for t in range(2)] == [1, 1]
    down = states((False, 0, 9, 0), (True, 5, 0, 0))
    assert cache_aware(down, 9, 0) == 1  # a replica that is down is never taken, whatever it holds


def test_the_prefix_table_matches_a_chain_and_forgets_what_a_replica_evicted():
    a = block_hashes(list(range(40)), 16)
    b = block_hashes(list(range(32)) + [99] * 16, 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] == b[1] and len(b) == 3
    assert block_hashes(list(range(40)), 16, salt="tenant-x")[0] != a[0]  # a salt changes every hash
    table = PrefixTable()
    table.insert(b)
    assert table.match(a) == 2 and table.match(block_hashes(list(range(1, 40)), 16)) == 0
    assert table.forgot(b, kept=1) == 2 and table.match(b) == 1 and table.capacity == 64  # shrunk (to its floor)


def chat(user: int, turns: int) -> dict:
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"user {user} asks question {t}: " + "why? " * 40})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer {t} to user {user}. " * 6})
    return {"model": MODEL, "messages": msgs}


def replay(policy: str, users: int = 5, turns: int = 4) -> tuple[list[list[int]], int]:
    """A scripted multi-turn chat load through RouterState alone: which replica got each user's turns,
    and how many prefix blocks the router found where it sent them."""
    state = RouterState(["http://a", "http://b", "http://c"], policy)
    where: list[list[int]] = [[] for _ in range(users)]
    matched = 0
    for t in range(1, turns + 1):
        for u in range(users):
            body = chat(u, t)
            units, block, salt = state.prefix_of(body, True, "")
            pick = state.pick(units, block, salt)
            matched += pick.matched
            where[u].append(state.replicas.index(pick.replica))
            state.release(pick)
            state.learn(pick, units + f"<assistant>answer {t - 1} to user {u}. " * 6 + "\x1e", block, salt, None)
    return where, matched


def test_cache_aware_keeps_each_users_turns_on_one_replica_where_round_robin_scatters_them():
    where, matched = replay("cache_aware")
    assert all(len(set(w)) == 1 for w in where), where  # each user sticks to the replica holding its chat
    assert sorted({w[0] for w in where}) == [0, 1, 2]  # and the users spread over the replicas
    scattered, rr_matched = replay("round_robin")
    assert all(len(set(w)) > 1 for w in scattered), scattered
    assert matched > rr_matched


def test_the_answers_cached_tokens_teach_the_router_that_a_replica_evicted():
    state = RouterState(["http://a", "http://b"], "cache_aware")
    ids = list(range(100))
    units, block, salt = state.prefix_of({"prompt": ids}, False, "")
    first = state.pick(units, block, salt)
    state.release(first)
    state.learn(first, "", block, salt, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}})
    again = state.pick(units, block, salt)
    assert again.replica is first.replica and again.matched == 6
    state.release(again)
    state.learn(again, "", block, salt, {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 32}})
    assert first.replica.forgotten_blocks == 4 and first.replica.cached_tokens == 32
    assert "minikv:router_forgotten_blocks_total" in state.render()


@pytest.mark.parametrize("backends, policy, words", [
    ([], "cache_aware", "at least one backend"),
    (["http://a:1", "http://a:1/"], "cache_aware", "given twice"),
    (["a:1"], "cache_aware", "http://HOST:PORT"),
    (["http://a:1"], "fastest", "cache_aware, round_robin, least_loaded"),
])
def test_bad_router_options_name_the_limit_and_the_fix(backends, policy, words):
    with pytest.raises(ValueError, match=words):
        RouterState(backends, policy)


def test_a_policy_that_picks_a_replica_that_is_down_is_refused_clearly():
    state = RouterState(["http://a", "http://b"], lambda replicas, blocks, turn: 5)
    with pytest.raises(RuntimeError, match="not the index of a replica"):
        state.pick([1, 2, 3], 16, "")


# ---- over HTTP: two replicas of one engine behind the router ------------------------------------------

def engine() -> LLM:
    return LLM(tiny_random_with_text(), kv_backend="paged", block_size=16, num_blocks=128, max_num_seqs=8,
               max_model_len=1024, prefix_caching="hash")


@pytest.fixture(scope="module")
def replicas():
    first = engine()
    servers = [Server(first, served_name=MODEL).start()]
    try:
        servers.append(Server(first.derive(), served_name=MODEL).start())
        yield servers, first.derive()
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def router(replicas, request):
    policy = getattr(request, "param", "cache_aware")
    # a generous probe timeout: no replica here is silent, and a busy machine must not take a healthy one out
    with Router([s.url for s in replicas[0]], policy, probe_interval=0.2, probe_timeout=HANG_S) as r:
        yield r


HTTP = httpx.Client(timeout=HANG_S, trust_env=False, limits=httpx.Limits(max_connections=32))


def post(url: str, body: dict, key: str = "alice") -> httpx.Response:
    return HTTP.post(url + "/v1/completions", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key}"})


def ids_of(i: int, n: int = 40) -> list[int]:
    return [(11 * i + 5 * j) % 500 + 3 for j in range(n)]


def sse_tokens(text: str) -> tuple[list[int], list[dict]]:
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [t for e in events for c in e.get("choices", []) for t in c.get("token_ids", [])], events


def test_tokens_through_the_router_are_the_engines_own_streamed_or_not(replicas, router):
    reference = replicas[1]
    prompts = [ids_of(i) for i in range(4)]
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=10, temperature=0))]
    want_seeded = reference.generate(prompts[0], SamplingParams(max_tokens=10, temperature=0.8, seed=7))[0].token_ids
    for p, w in zip(prompts, want):
        body = {"prompt": p, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        assert post(router.url, body).json()["choices"][0]["token_ids"] == w
        streamed = post(router.url, {**body, "stream": True})
        got, _ = sse_tokens(streamed.text)
        assert got == w and streamed.text.endswith("data: [DONE]\n\n")
    seeded = {"prompt": prompts[0], "max_tokens": 10, "temperature": 0.8, "seed": 7, "return_token_ids": True}
    assert post(router.url, seeded).json()["choices"][0]["token_ids"] == want_seeded
    text = HTTP.post(router.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}).json()
    assert text["choices"][0]["message"]["role"] == "assistant"
    assert HTTP.get(router.url + "/v1/models").json()["data"][0]["id"] == MODEL
    bad = post(router.url, {"prompt": [1, 2], "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]  # the replica's own 400


def test_cache_aware_routing_finds_the_cached_prefix_and_metrics_show_it_per_replica(router):
    shared = ids_of(50, 64)
    for i in range(4):  # one conversation's growing prompt, sent again and again
        out = post(router.url, {"prompt": shared + ids_of(60 + i, 16 * i), "max_tokens": 2}).json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    m = parse_metrics(HTTP.get(router.url + "/metrics").text)
    requests = {k: v for k, v in m.items() if k.startswith("minikv:router_requests_total")}
    assert sorted(requests.values()) == [0, 4]  # all on the replica that holds the prefix
    assert sum(v for k, v in m.items() if k.startswith("minikv:router_cached_tokens_total")) >= 3 * 64
    assert all(v == 1 for k, v in m.items() if k.startswith("minikv:router_replica_up"))


def test_a_tenants_cache_salt_passes_through_the_router(router):
    ids = ids_of(70, 48)
    post(router.url, {"prompt": ids, "max_tokens": 1, "cache_salt": "tenant-a"})
    same = post(router.url, {"prompt": ids, "max_tokens": 1, "cache_salt": "tenant-a"}).json()
    other = post(router.url, {"prompt": ids, "max_tokens": 1, "cache_salt": "tenant-b"}).json()
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("router", ["round_robin"], indirect=True)
def test_round_robin_through_the_router_alternates_replicas(router):
    for i in range(4):
        assert post(router.url, {"prompt": ids_of(80 + i, 8), "max_tokens": 1}).status_code == 200
    m = parse_metrics(HTTP.get(router.url + "/metrics").text)
    assert sorted(v for k, v in m.items() if k.startswith("minikv:router_requests_total")) == [2, 2]


def test_a_replica_that_refuses_or_never_answers_is_taken_out_and_the_request_served_elsewhere(replicas):
    reference = replicas[1]
    silent = socket.socket()  # listens, never accepts: connections open, no answer ever comes
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead = [f"http://127.0.0.1:{silent.getsockname()[1]}", f"http://127.0.0.1:{closed.getsockname()[1]}"]
    try:
        # the silent replica is found by its probe timing out; 5 s leaves the healthy one, answering from a
        # thread of this process, room to answer its own probes on a busy machine
        with Router([*dead, replicas[0][0].url], "round_robin", probe_interval=0.1, probe_timeout=5.0) as r:
            want = reference.generate(ids_of(90), SamplingParams(max_tokens=6, temperature=0))[0].token_ids
            for _ in range(3):
                out = post(r.url, {"prompt": ids_of(90), "max_tokens": 6, "temperature": 0, "return_token_ids": True})
                assert out.status_code == 200 and out.json()["choices"][0]["token_ids"] == want
            m = parse_metrics(HTTP.get(r.url + "/metrics").text)
            assert [m[f'minikv:router_replica_up{{replica="{u}"}}'] for u in dead] == [0, 0]
            assert m["minikv:router_retries_total"] >= 2
    finally:
        silent.close()
        closed.close()
    with Router(dead, "least_loaded", probe_interval=0.1, probe_timeout=0.5) as r:  # nobody left: a clear 503
        out = post(r.url, {"prompt": [1, 2, 3], "max_tokens": 2})
        assert out.status_code == 503 and "no replica could take this request" in out.json()["error"]["message"]
        assert HTTP.get(r.url + "/health").status_code == 503


@pytest.mark.slow  # three processes: the front and two replicas
def test_serve_data_parallel_starts_replicas_behind_a_router_and_survives_a_killed_replica():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minikv.cli", "serve", "--model", "tiny-random",
                             "--data-parallel-size", "2", "--no-engine-process", "--port", str(port),
                             "--num-blocks", "256", "--max-num-seqs", "16", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    pids: list[int] = []
    try:
        def up() -> bool:
            assert proc.poll() is None, f"minikv serve exited ({proc.returncode}): {proc.stdout.read()}"
            try:
                return HTTP.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "the router answers /health", poll_s=0.02)
        while not any(line.startswith("minikv: routing") for line in lines):
            lines.append(proc.stdout.readline())
        pids += [int(line.split("(pid ")[1].split(")")[0]) for line in lines if "(pid " in line]
        assert len(pids) == 2

        def ask(i: int) -> tuple[int, str]:
            body = {"model": MODEL, "prompt": ids_of(i, 24), "max_tokens": 64, "ignore_eos": True,
                    "stream": i % 3 == 0, "return_token_ids": True}
            r = HTTP.post(url + "/v1/completions", json=body)
            return r.status_code, r.text

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, i) for i in range(6)]

            def in_flight() -> list[float]:
                m = parse_metrics(HTTP.get(url + "/metrics").text)
                return [v for k, v in m.items() if k.startswith("minikv:router_requests_in_flight")]

            wait_until(lambda: min(in_flight()) >= 1 or all(f.done() for f in futures), "both replicas are busy",
                       poll_s=0.02)
            os.kill(pids[0], signal.SIGKILL)
            results = [f.result(timeout=HANG_S) for f in futures]
        for status, text in results:
            if text.startswith("data: "):  # a stream: whole, or cut short with an error chunk, ended by [DONE]
                assert status == 200 and text.endswith("data: [DONE]\n\n")
                got, events = sse_tokens(text)
                cut = [e for e in events if "error" in e]
                assert len(got) == 64 or (cut and "failed in the middle of this stream" in
                                           cut[0]["error"]["message"]), text[-300:]
            else:  # a whole answer: served (elsewhere if need be) or a clear 5xx
                assert status == 200 or (status >= 500 and "replica" in json.loads(text)["error"]["message"])
                if status == 200:
                    assert json.loads(text)["usage"]["completion_tokens"] == 64
        after = HTTP.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert after.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=HANG_S)
        left = [pid for pid in pids if alive(pid)]
        for pid in left:  # the front stops its replicas; should it fail to, the test still ends them
            os.kill(pid, signal.SIGKILL)
    out = "".join(lines) + proc.stdout.read()
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM) and "Traceback" not in out, out[-2000:]
    assert not left, f"replicas {left} outlived the front"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("argv, words", [
    (["route", "--port", "0"], "at least one backend"),
    (["route", "--decode", "http://d1", "--decode", "http://d2", "--prefill", "http://p1", "--port", "0"],
     "one --prefill URL per --decode URL"),
    (["route", "--backend", "http://b", "--prefill", "http://p", "--port", "0"], "give --decode URLs"),
    (["serve", "--model", "tiny-random", "--role", "decode", "--port", "0"], "needs --kv-address HOST:PORT"),
    (["serve", "--model", "tiny-random", "--data-parallel-size", "0", "--port", "0"], "at least 1"),
])
def test_bad_route_and_serve_options_are_one_line_errors(argv, words, capsys):
    from minikv.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
