"""One request must never hurt the others: a bad one gets an OpenAI-shaped 4xx and touches nothing
else; an engine fault fails the requests it hit and ends their streams; the engine loop survives any
error of a request; and should the loop end anyway, every client hears an error and the server stops.
Faults are injected with engine observers (as tests/test_faults.py does inside the engine)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from minikv import SamplingParams
from minikv.serve import Server, run
from minikv.serve.engine_loop import Event

from test_serve import HANG_S, MODEL, Gate, engine, wait_until


class Fault(Exception):
    """What the injectors raise."""


class FailNextStep:
    """An engine observer that makes the next step raise once armed (after the model ran: the step's
    tokens are lost, the engine recovers its state)."""

    def __init__(self, exc: type[BaseException] = Fault):
        self.armed, self.exc = False, exc

    def on_step(self, llm, batch, events):
        if self.armed:
            self.armed = False
            raise self.exc("injected step fault")


@pytest.fixture(scope="module")
def faulty():
    fault = FailNextStep()
    llm = engine()
    llm.add_observer(fault)
    with Server(llm, served_name=MODEL) as s:
        yield s, fault


@pytest.fixture(scope="module")
def server(faulty):
    return faulty[0]


@pytest.fixture(scope="module")
def reference(server):
    return server.engine.llm.derive()


HTTP = httpx.Client(timeout=HANG_S)


def post(server, route: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return HTTP.post(f"{server.url}/v1/{route}", content=body, headers={"content-type": "application/json"})
    return HTTP.post(f"{server.url}/v1/{route}", json=body)


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    for w in words:
        assert w in err["message"], err["message"]
    return err


def assert_still_serves(server, reference) -> None:
    assert HTTP.get(server.url + "/health").status_code == 200
    r = post(server, "completions", {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": 5, "ignore_eos": True,
                                     "temperature": 0, "return_token_ids": True})
    want = reference.generate([7, 8, 9], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want


# ---- a lone surrogate ----------------------------------------------------------------------------

SURROGATE_BODIES = [  # raw JSON: "\ud83d" is a valid JSON escape, but no Unicode text
    ("completions", b'{"model": "tiny-random", "prompt": "x \\ud83d", "max_tokens": 2}', "prompt"),
    ("chat/completions", b'{"model": "tiny-random", "messages": [{"role": "user", "content": "x \\ud83d"}]}',
     "messages[0].content"),
    ("completions", b'{"model": "tiny-random", "prompt": [1, 2], "stop": ["\\udc00"]}', "stop[0]"),
    ("completions", b'{"model": "\\ud83d", "prompt": [1, 2]}', "model"),
]


@pytest.mark.parametrize("route, body, param", SURROGATE_BODIES, ids=[b[2] for b in SURROGATE_BODIES])
def test_a_lone_surrogate_gets_400_and_the_server_serves_on(server, reference, route, body, param):
    err = assert_openai_error(post(server, route, body), 400, "lone UTF-16 surrogate")
    assert err["param"] == param
    assert_still_serves(server, reference)


def test_an_error_of_any_type_while_adding_a_request_fails_that_request_alone(server, reference):
    """Past the handler's checks (a caller of EngineLoop.submit): the tokenizer raises TypeError."""
    heard: list[Event] = []
    got = threading.Event()
    server.engine.submit({"prompt": "x \ud83d"}, SamplingParams(max_tokens=2), "t", "bad-1",
                         lambda ev: (heard.append(ev), got.set()))
    wait_until(got.is_set, "the engine answered the bad request")
    assert [e.kind for e in heard] == ["failed"] and "TypeError" in str(heard[0].error)
    assert server.engine.alive
    assert_still_serves(server, reference)


# ---- engine faults end every stream --------------------------------------------------------------

def test_a_stream_hit_by_an_engine_fault_gets_an_error_then_done_and_ends(faulty, reference):
    server, fault = faulty
    fault.armed = True
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=HANG_S) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]  # returns: the server closed the stream
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert "injected step fault" in err["message"] and err["type"] == "server_error"
    fault.armed = True
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=HANG_S)
    with pytest.raises(openai.APIError, match="injected step fault"):  # the client raises, as for OpenAI's errors
        for _ in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True):
            pass
    assert_still_serves(server, reference)


def test_a_whole_answer_hit_by_an_engine_fault_gets_an_openai_shaped_500(faulty, reference):
    server, fault = faulty
    fault.armed = True
    r = post(server, "completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True})
    assert_openai_error(r, 500, "injected step fault")
    assert_still_serves(server, reference)


def test_an_exception_of_any_kind_in_a_step_leaves_the_loop_running():
    fault = FailNextStep(KeyboardInterrupt)  # not an Exception: the loop still goes on
    llm = engine()
    llm.add_observer(fault)
    with Server(llm, served_name=MODEL) as s:
        fault.armed = True
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 3},
                       timeout=HANG_S)
        assert_openai_error(r, 500, "KeyboardInterrupt")
        assert s.engine.alive
        assert_still_serves(s, llm.derive())


def test_if_the_engine_loop_dies_every_client_hears_an_error_and_the_server_stops():
    gate = Gate(closed=True)
    llm = engine()
    llm.add_observer(gate)
    s = Server(llm, served_name=MODEL).start()
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=HANG_S) as r:
            wait_until(gate.holding.is_set, "the stream's request runs")

            def broken() -> None:  # the loop's own code fails (outside any request): a bug
                raise Fault("the loop's bookkeeping broke")

            s.engine._recount_waiting = broken  # called by the loop right after the step the gate holds
            gate.open()
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "the engine loop ended" in lines[-2]
        s._thread.join(HANG_S)  # the HTTP server stops by itself: nobody is left waiting on a dead engine
        assert not s._thread.is_alive() and isinstance(s.engine.error, Fault)
        heard: list[Event] = []
        s.engine.submit({"prompt_token_ids": [1]}, SamplingParams(), "t", "late", heard.append)
        assert [e.kind for e in heard] == ["failed"]  # at once, on the caller's thread
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=HANG_S)
    finally:
        gate.open()
        s.stop()


def test_numbers_too_large_for_the_engine_get_400_not_a_failed_step(server, reference):
    for field, value in (("top_k", 10**30), ("seed", 2**64), ("priority", "high"), ("n", 10**6)):
        r = post(server, "completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "temperature": 1.0,
                                         field: value})
        assert_openai_error(r, 400, field)
    assert_still_serves(server, reference)


# ---- malformed bodies ----------------------------------------------------------------------------

MALFORMED = [
    ("deep nesting", b"[" * 100_000, "nests too deeply"),
    ("deep nesting in an object", b'{"model": "tiny-random", "prompt": ' + b"[" * 100_000, "nests too deeply"),
    ("an integer of 5,000 digits", b'{"model": "tiny-random", "prompt": [' + b"7" * 5000 + b"]}", "not valid JSON"),
    ("invalid UTF-8", b'{"model": "tiny-random", "prompt": "\xff\xfe"}', "not valid JSON"),
    ("empty body", b"", "not valid JSON"),
]


@pytest.mark.parametrize("body, words", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_json_gets_an_openai_shaped_400(server, reference, body, words):
    for route in ("completions", "chat/completions"):
        assert_openai_error(post(server, route, body), 400, words)
    assert_still_serves(server, reference)


# ---- oversized prompts ---------------------------------------------------------------------------

def test_a_body_over_the_limit_gets_413_naming_the_limit_and_the_option():
    with Server(engine(), served_name=MODEL, max_body_bytes=10_000) as s:
        big = json.dumps({"model": MODEL, "prompt": "a" * 20_000}).encode()
        for how in ("content-length", "chunked"):  # declared, or found while reading
            content = big if how == "content-length" else iter([big[i:i + 4096] for i in range(0, len(big), 4096)])
            r = httpx.post(s.url + "/v1/completions", content=content, timeout=HANG_S,
                           headers={"content-type": "application/json"})
            assert_openai_error(r, 413, "10,000", "--max-body-bytes")
        ok = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a" * 500, "max_tokens": 2},
                        timeout=HANG_S)
        assert ok.status_code == 200


class Recorder:
    """Wraps a tokenizer method: which threads called it, with how long a text."""

    def __init__(self, tokenizer, name: str):
        self.calls: list[tuple[str, int]] = []
        original = getattr(tokenizer, name)

        def call(*args, **kwargs):
            self.calls.append((threading.current_thread().name, len(args[0]) if args else 0))
            return original(*args, **kwargs)

        setattr(tokenizer, name, call)


def test_prompts_are_tokenized_by_the_handlers_never_on_the_engine_thread():
    llm = engine()
    encode, template = Recorder(llm.tokenizer, "encode"), Recorder(llm.tokenizer, "apply_chat_template")
    with Server(llm, served_name=MODEL) as s:
        for route, body in (("completions", {"prompt": "the cache"}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                r = httpx.post(f"{s.url}/v1/{route}", json={"model": MODEL, "max_tokens": 3, "stream": stream, **body},
                               timeout=HANG_S)
                assert r.status_code == 200
    assert len(encode.calls) == 4 and len(template.calls) == 2
    assert all(name.startswith("minikv-tokenize") for name, _ in encode.calls + template.calls)


def test_a_text_far_over_max_model_len_is_refused_before_it_is_tokenized(server):
    encode = Recorder(server.engine.llm.tokenizer, "encode")
    try:
        r = post(server, "completions", {"model": MODEL, "prompt": "a" * 1_000_000, "max_tokens": 2})
        assert_openai_error(r, 400, "bytes of text", "max_model_len")
        assert all(n < 1_000_000 for _, n in encode.calls)  # the million-character text never was
        r = post(server, "completions", {"model": MODEL, "prompt": "a" * 2000, "max_tokens": 2})  # near: tokenized
        assert_openai_error(r, 400, "2,000 tokens", "max_model_len")
    finally:
        del server.engine.llm.tokenizer.encode


DYING_SERVER = """
import sys
from minikv import LLM
from minikv.serve import run
from minikv.serve.engine_loop import EngineLoop
from minikv.serve.tiny import tiny_random_with_text

def broken(self, events):  # the loop's own code fails after its first step: a bug, not a request's fault
    raise RuntimeError("the loop's bookkeeping broke")

EngineLoop._publish = broken
llm = LLM(tiny_random_with_text(), kv_backend="paged", block_size=16, num_blocks=64, max_model_len=256)
run(llm, "127.0.0.1", int(sys.argv[1]), "tiny-random", log_level="warning")
"""


@pytest.mark.slow
def test_minikv_serve_exits_with_status_1_when_its_engine_loop_dies():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, str(port)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=HANG_S).status_code == 200
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                return False  # not listening yet: wait_until polls again

        wait_until(up, "the server answers /health")
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 20, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "the engine loop ended" in lines[-2]
        assert proc.wait(timeout=HANG_S) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "exiting with status 1" in proc.stdout.read()


def test_run_refuses_a_body_limit_below_one_byte(capsys):
    with pytest.raises(SystemExit) as e:
        run(engine(), "127.0.0.1", 0, MODEL, max_body_bytes=0)
    assert e.value.code == 2 and "--max-body-bytes must be at least 1" in capsys.readouterr().err


def test_serve_refuses_a_stream_interval_below_one_token_before_loading_a_model(capsys):
    from minikv.cli import main

    assert main(["serve", "--model", "no-such-model", "--stream-interval", "0"]) == 2
    assert "--stream-interval must be at least 1, got 0" in capsys.readouterr().err
