"""Requests that arrive while a step is being launched run in the very next step (EngineCore.intake, and the
engine process's Inbox that drives it: minikv/serve/core_process.py).

With async scheduling the core forms step t+1 right after it launches step t, inside one call of `step()`:
a driver that adds requests only between calls is too late for t+1, and a burst's requests wait two steps.
`intake` is called right before each batch is formed, so the driver adds what has come by then.
"""
from __future__ import annotations

import queue

import pytest
from test_gc_pause import Pipe  # (tests/ is on the path) the engine process's pipes, as queues of this process

from minikv import LLM, SamplingParams
from minikv.serve.core_process import Inbox

PROMPTS = [[(7 * i + 5 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 13, 6))]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def tiny(async_scheduling: bool) -> LLM:
    return LLM("tiny-random", kv_backend="paged", async_scheduling=async_scheduling, block_size=4, num_blocks=96,
               max_num_seqs=8, max_num_batched_tokens=64)


class Batches:
    """An observer: the request ids of every batch, as each is formed."""

    def __init__(self):
        self.ids: list[list[str]] = []

    def on_schedule(self, llm, batch) -> None:
        self.ids.append([s.request_id for s in batch.seqs])


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_request_added_by_intake_runs_in_the_next_batch_with_the_tokens_it_gets_alone(overlap):
    llm = tiny(overlap)
    core, seen = llm.core, Batches()
    llm.add_observer(seen)
    core.add(llm.request(PROMPTS[0], PARAMS, "a"))

    arrived = []

    def intake():  # "b" arrives while the first step is launched
        if len(seen.ids) == 1 and not arrived:
            arrived.append(core.add(llm.request(PROMPTS[1], PARAMS, "b")))
    core.intake = intake
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    events = core.step()
    if not overlap:  # a plain step forms one batch per call: the next call forms the second
        events += core.step()
    assert seen.ids[0] == ["a"]
    assert "b" in seen.ids[1], f"b joined batches {[i for i, b in enumerate(seen.ids) if 'b' in b]}, not batch 1"
    if overlap:
        assert len(seen.ids) == 2  # both batches were formed inside the one call
    while core.has_unfinished():
        events += core.step()
    events += core.take_events()
    for e in events:
        if e.token_id is not None:
            tokens[e.request_id].append(e.token_id)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} blocks leaked"
    alone = [o.token_ids for o in tiny(False).generate(PROMPTS[:2], [PARAMS, PARAMS], use_tqdm=False)]
    assert [tokens["a"], tokens["b"]] == alone


class FakeCore:
    def __init__(self):
        self.calls: list[tuple] = []

    def add(self, request):
        self.calls.append(("add", request.request_id))

    def abort(self, request_id):
        self.calls.append(("abort", request_id))

    def close(self):
        self.calls.append(("close",))


class Req:
    def __init__(self, rid):
        self.request_id, self.prompt_token_ids = rid, [1, 2, 3]


def commands_of(cmds) -> Pipe:
    pipe = Pipe()
    for c in cmds:
        pipe.put(c)
    return pipe


def messages(results: Pipe) -> list:
    return list(results.q.queue)


class View:
    def snapshot(self):
        return "snapshot"


def test_the_inbox_takes_only_the_adds_at_the_head_inside_a_step_and_keeps_the_order():
    cmds = [("add", Req("r1")), ("batch", [("add", Req("r2")), ("add", Req("r3"))]), ("abort", "r1"),
            ("add", Req("r4")), ("stop",)]
    core, results = FakeCore(), Pipe()
    inbox = Inbox(core, commands_of(cmds), results, View())
    inbox.intake()  # inside a step: the two adds at the head (three requests), then the abort is held
    assert core.calls == [("add", "r1"), ("add", "r2"), ("add", "r3")]
    assert inbox.applied == 2 and inbox.held == ("abort", "r1")
    assert messages(results) == [("answers", [("accepted", r, 3) for r in ("r1", "r2", "r3")], "snapshot")]
    inbox.intake()  # a held command blocks the head: nothing more inside this step
    assert len(core.calls) == 3 and len(messages(results)) == 1
    # after the step, the loop reads on in order: the held abort first, then the rest
    applied = []
    while True:
        try:
            cmd = inbox.get()
        except queue.Empty:
            break
        applied.append(cmd[0])
        if not inbox.apply(cmd):
            break
    assert applied == ["abort", "add", "stop"]
    assert core.calls[3:] == [("abort", "r1"), ("add", "r4"), ("close",)]
    assert messages(results)[-1] == ("stopped",)


def test_the_inbox_holds_a_batch_that_is_not_all_adds():
    cmds = [("batch", [("add", Req("r1")), ("abort", "r0")]), ("add", Req("r2"))]
    core, results = FakeCore(), Pipe()
    inbox = Inbox(core, commands_of(cmds), results, View())
    inbox.intake()
    assert core.calls == [] and messages(results) == [] and inbox.held[0] == "batch"
    assert inbox.apply(inbox.get()) and core.calls == [("add", "r1"), ("abort", "r0")]
