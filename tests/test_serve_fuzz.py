"""Random bytes, random JSON and random Unicode (lone surrogates included) at every route, for a few
seconds: every answer is well formed (an OpenAI-shaped error, never a 500 nor a dropped connection),
and afterwards the server is healthy and serves a well-formed request token for token as the engine
does in-process. The seed is printed; MINIKV_FUZZ_SEED=... replays a run, MINIKV_FUZZ_S=... fuzzes longer."""
from __future__ import annotations

import json
import os
import random
import time

import httpx
import pytest

from minikv import SamplingParams
from minikv.serve import Server

from test_serve import HANG_S, MODEL, engine

SEED = int(os.environ.get("MINIKV_FUZZ_SEED", "20261127"))
FUZZ_S = float(os.environ.get("MINIKV_FUZZ_S", "4"))  # how long (a bound on the work: the checks hold for every case)
MAX_CASES = int(os.environ.get("MINIKV_FUZZ_CASES", "600"))
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/models"), ("GET", "/v1/completions"),
          ("POST", "/v1/embeddings"), ("PUT", "/v1/chat/completions"), ("POST", "/")]
CHAR_RANGES = [(0x20, 0x7E), (0x0, 0x1F), (0x80, 0x7FF), (0x4E00, 0x4FFF), (0xD800, 0xDFFF), (0x1F600, 0x1F64F),
               (0xFFF0, 0xFFFF)]
KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
        "n", "seed", "stop", "stream", "stream_options", "user", "cache_salt", "ignore_eos", "priority",
        "return_token_ids", "logprobs", "role", "content", "include_usage", "continuous_usage_stats"]

NUMBER_KEYS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed", "priority"]
EXTREMES = [-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308, 1e-308, float("nan"),
            float("inf"), 0.5, True]


def text(rng: random.Random) -> str:
    lo, hi = rng.choice(CHAR_RANGES)
    return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.choice([0, 1, 3, 12, 40])))


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 1024, 1025, 2**31, 2**63, -(2**63), 10**30, rng.randint(-50, 50)])
    if kind == 3:
        return rng.choice([0.0, -0.5, 0.5, 1.5, 2.0, 1e-300, 1e300, float("nan"), float("inf")])
    if kind in (4, 5, 6):
        return text(rng) if kind != 6 else rng.choice(KEYS + [MODEL, "user", "assistant", "system"])
    if kind in (7, 8):
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(KEYS) if rng.random() < 0.7 else text(rng): value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def valid(rng: random.Random, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7]),
            "stream": rng.random() < 0.4}
    if chat:
        body["messages"] = [{"role": rng.choice(["user", "system", "assistant"]), "content": text(rng) or "x"}]
    else:
        body["prompt"] = text(rng) or "x" if rng.random() < 0.6 else [rng.randrange(3, 500) for _ in range(5)]
    return body


def mutated(rng: random.Random, chat: bool) -> dict:
    body = valid(rng, chat)
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(KEYS)
        if rng.random() < 0.3:
            body.pop(key, None)
        else:
            body[key] = value(rng)
    for key in ("max_tokens", "max_completion_tokens"):  # valid ones stay short: the fuzz is about inputs
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and 4 < body[key] <= 1024:
            body[key] = 4
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:  # chat: to the context
        body["max_tokens"] = 4
    return body


def payload(rng: random.Random, path: str) -> bytes:
    kind = rng.randrange(7)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if kind == 1:
        return json.dumps(value(rng)).encode()  # lone surrogates travel as \udxxx escapes
    if kind == 2:
        raw = json.dumps(mutated(rng, "chat" in path)).encode()
        cut = rng.randrange(len(raw) + 1)
        return raw[:cut] if rng.random() < 0.3 else raw
    if kind == 3:
        return rng.choice([b"[" * 50_000, b'{"a":' * 30_000, b"9" * 5000, b'"\\ud83d"', b"\xed\xa0\xbd", b"{}",
                           b"null", b"NaN", b'{"model": "tiny-random", "prompt": [' + b"7" * 4400 + b"]}"])
    if kind == 4:  # a valid body but for one number at an extreme
        body = valid(rng, "chat" in path)
        body[rng.choice(NUMBER_KEYS)] = rng.choice(EXTREMES)
        return json.dumps(body).encode()
    return json.dumps(mutated(rng, "chat" in path)).encode()


def check(method: str, path: str, r: httpx.Response, body: bytes) -> None:
    where = f"{method} {path} {body[:200]!r} -> {r.status_code} {r.text[:300]!r}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), where
        return
    if path == "/metrics":
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]", where
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            assert "choices" in chunk and "error" not in chunk, where
        return
    out = r.json()
    if path in ("/v1/completions", "/v1/chat/completions"):
        assert out["choices"] and out["usage"]["completion_tokens"] >= 1, where


@pytest.fixture(scope="module")
def server():
    with Server(engine(), served_name=MODEL) as s:
        yield s


def test_random_requests_at_every_route_never_break_the_server(server):
    print(f"fuzz seed {SEED} (replay: MINIKV_FUZZ_SEED={SEED})")
    rng = random.Random(SEED)
    deadline, cases = time.monotonic() + FUZZ_S, 0
    with httpx.Client(timeout=HANG_S) as http:
        while cases < MAX_CASES and time.monotonic() < deadline:
            method, path = rng.choice(ROUTES)
            body = payload(rng, path) if method != "GET" else b""
            headers = {"content-type": rng.choice(["application/json", "text/plain",
                                                   "application/x-www-form-urlencoded"])}
            if rng.random() < 0.5:
                headers["authorization"] = rng.choice(["Bearer alice", "Bearer", "Basic eA==", "bearer  x",
                                                       "Bearer a b"])
            r = http.request(method, server.url + path, content=body, headers=headers)
            check(method, path, r, body)
            cases += 1
    print(f"{cases} cases")
    assert cases >= 20
    assert httpx.get(server.url + "/health", timeout=HANG_S).json() == {"status": "ok"}
    ids = [11, 22, 33, 44]
    r = httpx.post(server.url + "/v1/completions", timeout=HANG_S,
                   json={"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    want = server.engine.llm.derive().generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    assert server.engine.alive


def test_the_bytes_check_for_surrogates_misses_no_body_whose_walk_finds_one():
    """The handler walks a parsed body for lone surrogates only when its bytes may hold one
    (`may_hold_surrogate`): every random body whose walk finds one must be flagged by its bytes, as UTF-8
    (escapes, or a surrogate's own bytes, which json.loads takes with surrogatepass) and as UTF-16."""
    from minikv.serve.protocol import lone_surrogate, may_hold_surrogate

    rng = random.Random(17)
    found = flagged = 0
    for i in range(3000):
        body = mutated(rng, i % 2 == 0) if i % 3 else value(rng)
        escaped = json.dumps(body).encode()
        raws = [escaped, json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"),
                json.dumps(body).encode("utf-16")]
        for raw in raws:
            parsed = json.loads(raw)
            flagged += may_hold_surrogate(raw)
            if lone_surrogate(parsed) is not None:
                found += 1
                assert may_hold_surrogate(raw), raw[:200]
    assert found > 100 and flagged < 3 * 3000, (found, flagged)  # the check met surrogates, and passes most
