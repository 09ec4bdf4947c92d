"""Streamed answers as the OpenAI API specifies them: every chunk's fields and types, the role on chat's
first chunk, finish_reason on the last content chunk, usage only when asked (stream_options), and
`data: [DONE]` last; and the official `openai` client reading them as applications do."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from minikv import SamplingParams
from minikv.serve import Server

from test_serve import HANG_S, MODEL, engine


@pytest.fixture(scope="module")
def server():
    with Server(engine(), served_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    return server.engine.llm.derive()


def sse(server, route: str, body: dict) -> list[dict]:
    """The chunks of one stream, checked as server-sent events that end with `data: [DONE]`."""
    with httpx.stream("POST", f"{server.url}/v1/{route}", json={"model": MODEL, "stream": True, **body},
                      timeout=HANG_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def check_chunk(chunk: dict, chat: bool, usage_expected: str) -> None:
    """One chunk against the spec. usage_expected: "absent", "null" or "object"."""
    assert isinstance(chunk["id"], str) and chunk["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert isinstance(chunk["created"], int) and chunk["model"] == MODEL
    assert isinstance(chunk["choices"], list)
    for c in chunk["choices"]:
        assert isinstance(c["index"], int) and c["finish_reason"] in (None, "stop", "length")
        if chat:
            assert set(c["delta"]) <= {"role", "content"} and isinstance(c["delta"].get("content", ""), str)
        else:
            assert isinstance(c["text"], str)
    if usage_expected == "absent":
        assert "usage" not in chunk
    elif usage_expected == "null":
        assert chunk["usage"] is None
    else:
        u = chunk["usage"]
        assert all(isinstance(u[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_stream_without_stream_options_has_no_usage_chunk_and_every_chunk_follows_the_spec(server, reference,
                                                                                              chat):
    body = {"max_tokens": 7, "temperature": 0, "ignore_eos": True}
    if chat:
        msgs = [{"role": "user", "content": "hello"}]
        chunks = sse(server, "chat/completions", {**body, "messages": msgs})
        prompt = reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        chunks = sse(server, "completions", {**body, "prompt": "the cache"})
        prompt = "the cache"
    for c in chunks:
        check_chunk(c, chat, "absent")
        assert len(c["choices"]) == 1  # no chunk without choices: nobody asked for usage
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    if chat:  # the first chunk names the role, the others carry content only
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}  # on the last content chunk, only there
    text = "".join(c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks)
    assert text == reference.generate(prompt, SamplingParams(max_tokens=7, ignore_eos=True))[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_include_usage_adds_one_last_chunk_with_usage_and_no_choices(server, chat):
    body = {"max_tokens": 5, "ignore_eos": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [4, 5, 6]})
    chunks = sse(server, "chat/completions" if chat else "completions", body)
    for c in chunks[:-1]:
        check_chunk(c, chat, "null")
        assert len(c["choices"]) == 1
    last = chunks[-1]
    check_chunk(last, chat, "object")
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    if not chat:
        assert last["usage"]["prompt_tokens"] == 3


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    chunks = sse(server, "completions", {"prompt": [4, 5, 6], "max_tokens": 6, "ignore_eos": True,
                                         "stream_options": {"continuous_usage_stats": True}})
    for c in chunks:
        check_chunk(c, False, "object")
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 6 and chunks[-1]["usage"]["prompt_tokens"] == 3


def test_stream_options_must_be_true_or_false(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1], "stream": True,
                                                          "stream_options": {"include_usage": "yes"}}, timeout=HANG_S)
    assert r.status_code == 400 and "include_usage" in r.json()["error"]["message"]


def test_the_openai_client_reads_every_chunk_as_applications_do(server, reference):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=HANG_S)
    msgs = [{"role": "user", "content": "hi"}]
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)  # raises nothing: choices never empty
    prompt = reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == reference.generate(prompt, SamplingParams(max_tokens=6))[0].text
    pieces = [chunk.choices[0].text for chunk in
              c.completions.create(model=MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True)]
    assert "".join(pieces) == reference.generate("abc", SamplingParams(max_tokens=4))[0].text
    with_usage = list(c.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4


def test_a_burst_of_engine_events_wakes_the_event_loop_once_and_keeps_their_order():
    """The engine thread's events reach the handlers through a Mailbox: one wake-up of the event loop
    for all the events put before it runs (not one per event), each handler's in order; once the loop
    is closed, put raises, so the engine loop knows nobody listens."""
    import asyncio

    from minikv.serve.app import Mailbox
    from minikv.serve.engine_loop import Event

    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakeups.append(1), real(*a))[1]
    box = Mailbox(loop)
    queues = [asyncio.Queue(), asyncio.Queue()]
    for i in range(100):
        box.put(queues[i % 2], Event("tokens", token_ids=[i]))
    assert len(wakeups) == 1
    loop.run_until_complete(asyncio.sleep(0))
    for k, q in enumerate(queues):
        assert [q.get_nowait().token_ids[0] for _ in range(50)] == list(range(k, 100, 2)) and q.empty()
    box.put(queues[0], Event("end"))  # a later batch: its own wake-up
    assert len(wakeups) == 2
    loop.run_until_complete(asyncio.sleep(0))
    assert queues[0].get_nowait().kind == "end"
    loop.close()
    with pytest.raises(RuntimeError):
        box.put(queues[0], Event("end"))


class HoldSecondStep:
    """An engine observer that holds the engine at the end of its second step until the test releases it:
    the first token is out (published after step 1), the second is not."""

    def __init__(self):
        self.steps, self.holding, self.release = 0, threading.Event(), threading.Event()

    def on_step(self, llm, batch, events):
        self.steps += 1
        if self.steps == 2:
            self.holding.set()
            self.release.wait(HANG_S)  # (never forever: a test that fails to release fails, it does not hang)


def test_a_stream_interval_sends_the_first_token_at_once_then_chunks_of_that_many_tokens():
    """stream_interval=4: the first token reaches the client while the engine holds the second (so its
    time to first token is not delayed), every later chunk but the last holds at least 4 tokens, and the
    stream joins to the same tokens and text as the whole answer: 11 tokens in at most 1 + ceil(10 / 4) = 4
    chunks (one a token: 11)."""
    body = {"model": MODEL, "prompt": "the cache", "max_tokens": 11, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    llm, hold = engine(), HoldSecondStep()
    llm.add_observer(hold)
    with Server(llm, served_name=MODEL, stream_interval=4) as s:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=HANG_S) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)  # (before the release: the second token is not out)
            assert hold.holding.wait(HANG_S) and not hold.release.is_set()
            hold.release.set()
            rest = [line for line in lines if line]
        whole = httpx.post(f"{s.url}/v1/completions", json=body, timeout=HANG_S).json()["choices"][0]
    assert rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in [first] + rest[:-1]]
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 11, sizes
    assert len(chunks) <= 4 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_a_stream_interval_below_one_token_is_refused_with_the_fix(bad):
    from minikv.serve.app import build_app
    from minikv.serve.engine_loop import EngineLoop

    with pytest.raises(ValueError, match="stream_interval must be a whole number of tokens, at least 1"):
        build_app(EngineLoop.__new__(EngineLoop), MODEL, stream_interval=bad)
