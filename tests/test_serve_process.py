"""`minikv serve` with the EngineCore in a process of its own (minikv/serve/core_process.py): the same
tokens as generate in this process, a client that goes away frees its blocks, a prompt the engine
refuses gets a 400, and an engine process that dies stops the server instead of leaving clients waiting."""
from __future__ import annotations

import json

import httpx
import pytest

from minikv import LLM, SamplingParams
from minikv.serve import Server, parse_metrics
from minikv.serve.core_process import CoreProcess
from minikv.serve.tiny import tiny_random_with_text

from test_serve import HANG_S, wait_until  # noqa: E402  (tests/ is on the path)

pytestmark = pytest.mark.slow  # a spawned interpreter imports torch and builds the engine: seconds
OPTIONS = dict(kv_backend="paged", block_size=16, num_blocks=96, max_num_seqs=8, max_model_len=1024,
               prefix_caching="hash")
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 7, 8, 200, 31]]


@pytest.fixture(scope="module")
def served():
    proc = CoreProcess(tiny_random_with_text(), **OPTIONS)
    with Server(proc, served_name="tiny") as server:
        yield server, proc


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=HANG_S).text)


def test_tokens_through_the_engine_process_equal_generate_in_this_process(served):
    server, _ = served
    want = LLM(tiny_random_with_text(), **OPTIONS).generate(
        PROMPTS, [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=7, temperature=0.8, seed=5),
                  SamplingParams(max_tokens=9, ignore_eos=True)])
    bodies = [dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, ignore_eos=True, temperature=0),
              dict(model="tiny", prompt=PROMPTS[1], max_tokens=7, temperature=0.8, seed=5),
              dict(model="tiny", prompt=PROMPTS[2], max_tokens=9, ignore_eos=True, temperature=0, stream=True)]
    got = []
    for body in bodies[:2]:
        r = httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=HANG_S)
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["token_ids"])
    ids = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**bodies[2], "return_token_ids": True},
                      timeout=HANG_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    got.append(ids)
    assert got == [o.token_ids for o in want]


def test_a_client_that_goes_away_has_its_blocks_freed_in_the_engine_process(served):
    server, _ = served
    body = dict(model="tiny", prompt=PROMPTS[0], max_tokens=1000, ignore_eos=True, stream=True)
    before = metrics(server.url).get('minikv:request_success_total{finished_reason="abort"}', 0)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token came: hang up
    wait_until(lambda: (lambda m: m.get('minikv:request_success_total{finished_reason="abort"}', 0) == before + 1
                        and m["minikv:num_requests_running"] == 0 and m["minikv:kv_cache_usage_perc"] == 0)(
        metrics(server.url)), "the engine process aborted the request and freed its blocks")


def test_a_prompt_over_the_limit_is_refused_with_400(served):
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", json=dict(model="tiny", prompt=[1] * 1025, max_tokens=2),
                   timeout=HANG_S)
    assert r.status_code == 400 and "max_model_len" in r.text


def test_an_engine_process_that_dies_stops_the_server_and_nobody_hangs():
    proc = CoreProcess(tiny_random_with_text(), **OPTIONS)
    server = Server(proc, served_name="tiny").start()
    try:
        assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
        proc.kill()
        wait_until(lambda: server.engine.error is not None, "the server noticed the engine process ended")
        assert "the engine process ended" in str(server.engine.error)
        try:
            r = httpx.post(server.url + "/v1/completions", json=dict(model="tiny", prompt=[1, 2], max_tokens=2),
                           timeout=HANG_S)
            assert r.status_code >= 500
        except httpx.TransportError:
            pass  # the HTTP server stopped with it: refused, not left waiting
    finally:
        server.stop()


def test_an_option_the_engine_refuses_is_the_same_one_line_error_as_in_process():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        CoreProcess(tiny_random_with_text(), kv_backend="paged", block_size=3)
    with pytest.raises(FileNotFoundError):
        CoreProcess("/nonexistent/model-dir", kv_backend="paged")


def test_a_request_aborted_before_the_engine_process_answered_is_stopped_there(served):
    server, _ = served
    before = metrics(server.url).get('minikv:request_success_total{finished_reason="abort"}', 0)
    heard = []
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    server.engine.submit({"prompt_token_ids": PROMPTS[0]}, params, "t", "early-abort", heard.append)
    server.engine.abort("early-abort")  # queued right behind the submit: the core may not have answered yet
    wait_until(lambda: (lambda m: m.get('minikv:request_success_total{finished_reason="abort"}', 0) == before + 1
                        and m["minikv:num_requests_running"] == 0 and m["minikv:kv_cache_usage_perc"] == 0)(
        metrics(server.url)), "the engine process stopped the request and freed its blocks")
    assert all(e.kind in ("accepted", "tokens") for e in heard)
