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


def completions(url: str, body: dict) -> dict:
    """One answer through the server, streamed or not, as {"texts", "ids", "reasons", "usage"} per sample."""
    n = body.get("n", 1)
    texts, ids, reasons, usage = [""] * n, [[] for _ in range(n)], [None] * n, None
    body = {**body, "model": "tiny", "return_token_ids": True}
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            texts[c["index"]], ids[c["index"]], reasons[c["index"]] = c["text"], c["token_ids"], c["finish_reason"]
        return dict(texts=texts, ids=ids, reasons=reasons, usage=r.json()["usage"]["completion_tokens"])
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}},
                      timeout=HANG_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                ids[c["index"]] += c.get("token_ids") or []
                reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    return dict(texts=texts, ids=ids, reasons=reasons, usage=usage)


def test_text_made_in_the_server_equals_generate_with_and_without_stop_strings(served):
    """The core sends token ids and the server makes the text (stop-string requests keep theirs in the
    core): text, tokens, finish reasons and usage are generate's, greedy and seeded, n = 1 and n = 3."""
    server, proc = served
    assert proc.text_in_server
    llm = LLM(tiny_random_with_text(), **OPTIONS)
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    text = greedy.text
    stop = next(text[i:i + 2] for i in range(8, len(text) - 2)
                if text[i:i + 2].isprintable() and text.find(text[i:i + 2]) == i)  # first seen mid-way
    sampled = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0.9, seed=11, n=3))[0]
    first = sorted(sampled.outputs, key=lambda c: c.index)[0].text
    stop_n = next(c for c in first[5:] if c.isprintable() and c != " ")  # ends sample 0 mid-way, maybe others
    cases = [dict(max_tokens=40, ignore_eos=True, temperature=0),
             dict(max_tokens=40, ignore_eos=True, temperature=0, stop=[stop]),
             dict(max_tokens=30, temperature=0.9, seed=11, n=3),
             dict(max_tokens=30, temperature=0.9, seed=11, n=3, stop=[stop_n]),
             dict(max_tokens=30, temperature=1.0, seed=3, top_k=50)]
    stopped = 0
    for case in cases:
        params = SamplingParams(**case)
        want = llm.generate([PROMPTS[0]], params)[0]
        samples = sorted(want.outputs, key=lambda c: c.index)
        stopped += sum(c.finish_reason == "stop" for c in samples) if case.get("stop") else 0
        for stream in (False, True):
            got = completions(server.url, dict(prompt=PROMPTS[0], stream=stream, **case))
            assert got["texts"] == [c.text for c in samples], (case, stream)
            assert got["ids"] == [c.token_ids for c in samples], (case, stream)
            assert got["reasons"] == [c.finish_reason for c in samples], (case, stream)
            assert got["usage"] == sum(len(c.token_ids) for c in samples), (case, stream)
    assert stopped >= 2  # the stop strings did end samples (the rule under test ran)
    llm.close()


def test_a_core_that_sends_ids_only_leaves_the_text_to_its_client_but_still_ends_on_stop_strings():
    llm = LLM(tiny_random_with_text(), **OPTIONS)
    llm.core.detokenize = False
    plain = llm.core.add(llm.request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True)))
    full = LLM(tiny_random_with_text(), **OPTIONS).generate([PROMPTS[0]], SamplingParams(max_tokens=20,
                                                                                          ignore_eos=True))[0]
    stop = next(full.text[i:i + 2] for i in range(4, len(full.text) - 2) if full.text.find(full.text[i:i + 2]) == i)
    stopping = llm.core.add(llm.request(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]),
                                        request_id="with-stop"))
    events = []
    while llm.core.has_unfinished():
        events += llm.core.step()
    assert plain.text == "" and all(e.text_delta == "" for e in events if e.request_id == plain.request_id)
    assert stopping.finish_reason == "stop" and stopping.text == full.text[:full.text.find(stop)]
    assert "".join(e.text_delta for e in events if e.request_id == "with-stop") == stopping.text


def fake_engine_process(messages: list):
    """What ProcessEngineLoop reads of a CoreProcess, with no process: each message sent lands in `messages`."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from minikv.engine.core import EngineRequest
    from minikv.serve.core_process import EventReader

    reader, writer = mp.Pipe(duplex=False)  # (the write end kept open: no core, and no end of its messages)

    def request(prompt, params, rid, tenant):
        if len(prompt["prompt_token_ids"]) > 1024:  # as CoreProcess.encode refuses it
            raise ValueError("prompt has 2,000 tokens but max_model_len is 1,024")
        return EngineRequest(prompt["prompt_token_ids"], params, rid, tenant=tenant)

    return SimpleNamespace(snapshot=None, tokenizer=None, text_in_server=True, alive=True,
                           results=EventReader(reader), core_end=writer, request=request,
                           commands=SimpleNamespace(pending=0, flush=lambda: True),
                           send=lambda *command: messages.append([command]), send_many=messages.append,
                           stop=lambda: None)


def test_a_submit_reaches_the_engine_process_from_the_submitting_thread_in_order():
    """A handler's submit sends its request to the core itself, at once: the engine thread (not even
    started here) is not on the way, so an event loop busy with a burst never holds a request back (two
    threads share one interpreter lock: core_process.py's top). Aborts follow through the engine thread,
    after the adds they stop; a prompt the server refuses is answered at once and never sent."""
    from minikv.serve.engine_loop import ProcessEngineLoop

    messages, heard = [], []
    loop = ProcessEngineLoop(fake_engine_process(messages))
    for i in range(5):
        loop.submit({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), "t", f"r{i}", lambda e: None)
        assert len(messages) == i + 1  # sent before submit returned
    assert loop.num_queued("t") == 5  # pending until the core answers: they count for 429/503
    loop.submit({"prompt_token_ids": [1] * 2000}, SamplingParams(max_tokens=4), "t", "long", heard.append)
    assert [e.kind for e in heard] == ["rejected"] and "max_model_len" in str(heard[0].error)
    loop.abort("r2")
    loop._drain()
    assert [(c[0], c[1] if c[0] == "abort" else c[1].request_id) for m in messages for c in m] == \
        [("add", "r0"), ("add", "r1"), ("add", "r2"), ("add", "r3"), ("add", "r4"), ("abort", "r2")]
    assert loop.num_queued("t") == 5


def test_a_submit_is_answered_failed_by_a_closing_loop_whether_it_came_before_or_after():
    """A submit sent before the loop closes hears "failed" from the close; one after it hears it at once:
    none is left waiting for a core that will never answer."""
    from minikv.serve.engine_loop import ProcessEngineLoop

    messages, before, after = [], [], []
    loop = ProcessEngineLoop(fake_engine_process(messages))
    loop.submit({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), "t", "r0", before.append)
    loop._close()
    loop.submit({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), "t", "r1", after.append)
    assert [e.kind for e in before] == ["failed"] and [e.kind for e in after] == ["failed"]
    assert len(messages) == 1  # the second was never sent
    assert loop.num_queued("t") == 0


def test_a_submit_to_an_idle_server_reaches_the_engine_process_at_once():
    """The engine thread waits for the core's messages and for submits together: a submit is sent on at
    once, not when the thread's wait for the core times out (here a minute) or the core's next step ends."""
    from minikv.serve.engine_loop import ProcessEngineLoop

    messages = []
    loop = ProcessEngineLoop(fake_engine_process(messages), idle_wait=60.0).start()
    try:
        for i in range(2):  # the second comes while the thread waits for the core, idle
            loop.submit({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4), "t", f"r{i}", lambda e: None)
            # 20 s: far less than the minute the thread would otherwise wait
            wait_until(lambda: len(messages) >= i + 1, "the submit reached the core before the thread's wait "
                       "timed out", timeout_s=20.0)
    finally:
        loop.stop()


def test_events_cross_the_process_boundary_with_every_field():
    """The core sends a step's events as plain tuples (a tenth of a dataclass's pickling time); read
    back, each has every field of the EngineEvent it was, by name."""
    import dataclasses
    import pickle

    from minikv.engine.core import EngineEvent, Usage
    from minikv.serve.core_process import from_wire, to_wire

    usage = Usage(3, 2, 0, 0, 1.0, (1.5, 2.0))
    events = [EngineEvent("a", 0, 7, "x"), EngineEvent("b", 2, None, "", "error", "why", usage)]
    for event, read in zip(events, from_wire(pickle.loads(pickle.dumps(to_wire(events))))):
        names = [f.name for f in dataclasses.fields(EngineEvent)]
        assert [getattr(read, n) for n in names] == [getattr(event, n) for n in names]


def test_the_cores_messages_never_block_it_and_reach_the_server_whole_and_in_order():
    """The core pickles and writes its messages itself (core_process.py's top: no feeder thread): a put
    returns at once even when the server reads nothing (what the pipe cannot take waits in the writer), and
    the server then reads every message whole, in order, as a Connection reads them."""
    import multiprocessing as mp
    import queue
    import time

    from minikv.serve.core_process import EventReader, EventWriter

    reader_end, writer_end = mp.Pipe(duplex=False)
    writer, reader = EventWriter(writer_end), EventReader(reader_end)
    with pytest.raises(queue.Empty):
        reader.get_nowait()
    big = [("events", list(range(i, i + 20_000)), i) for i in range(6)]  # ~100 KB each: more than a pipe holds
    t0 = time.perf_counter()
    for msg in big:
        writer.put(msg)
    assert time.perf_counter() - t0 < 5.0 and writer.pending > 0  # it returned with bytes left to write
    got = []
    while len(got) < len(big):
        writer.flush()  # (the core flushes on every put, and every few ms while idle)
        try:
            got.append(reader.get(timeout=0.05))
        except queue.Empty:
            pass
    assert got == big and writer.flush() and writer.pending == 0
    writer.put(("stopped",))
    assert writer.finish(timeout=5.0) and reader.get(timeout=5.0) == ("stopped",)
    writer_end.close()
    with pytest.raises(queue.Empty):  # the core's end is closed: nothing more will come, and get says so
        reader.get(timeout=5.0)


def test_a_core_whose_server_is_gone_drops_its_messages_instead_of_failing():
    import multiprocessing as mp

    from minikv.serve.core_process import EventWriter

    reader_end, writer_end = mp.Pipe(duplex=False)
    writer = EventWriter(writer_end)
    reader_end.close()
    writer.put(("events", [1, 2, 3], None, None))  # no BrokenPipeError out of the core's step loop
    assert writer.pending == 0 and writer.finish(timeout=1.0)


def test_commands_from_several_threads_reach_the_core_whole_and_in_each_threads_order():
    """The server's command pipe takes puts from any thread (handlers' adds on the event loop, the engine
    thread's aborts) without blocking them, even when the core reads nothing for a while: each message
    arrives whole, and each thread's in the order it put them."""
    import multiprocessing as mp
    import queue
    import threading

    from minikv.serve.core_process import CommandWriter, EventReader

    reader_end, writer_end = mp.Pipe(duplex=False)
    writer, reader = CommandWriter(writer_end), EventReader(reader_end)
    per_thread = 40
    go = threading.Barrier(3)

    def put_all(name):
        go.wait()
        for i in range(per_thread):
            writer.put(("add", name, i, list(range(3000))))  # ~15 KB each: far more than a pipe holds

    threads = [threading.Thread(target=put_all, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads)  # none blocked on the full pipe
    got = []
    while len(got) < 3 * per_thread:
        writer.flush()  # (ProcessEngineLoop flushes on each turn of its thread)
        try:
            got.append(reader.get(timeout=0.05))
        except queue.Empty:
            pass
    assert all(m[3] == list(range(3000)) for m in got)
    for name in "abc":
        assert [m[2] for m in got if m[1] == name] == list(range(per_thread))
    assert writer.flush() and writer.pending == 0


def test_an_engine_process_whose_server_lets_go_of_its_commands_ends():
    """A core whose command pipe is closed without a stop (its CoreProcess dropped) ends: it does not
    wait for commands that can never come."""
    proc = CoreProcess(tiny_random_with_text(), **OPTIONS)
    try:
        proc.commands._conn.close()
        proc.process.join(HANG_S)
        assert not proc.process.is_alive()
    finally:
        proc.kill()
