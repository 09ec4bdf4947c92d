"""generate() keeps the garbage collector off the objects that lived before it (gc.freeze), and gives
them back to it afterwards, whatever happens; a heap the caller froze stays the caller's (frozen further
while the run lasts, and after)."""
import gc
import queue
import threading

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.gc_pause import frozen_heap

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=32)


class FreezeSeen:
    """An engine observer: the collector's frozen count at every step."""

    def __init__(self):
        self.counts = []

    def on_step(self, llm, batch, events):
        self.counts.append(gc.get_freeze_count())


def freeze_counts_during(llm, prompts) -> list[int]:
    """The collector's frozen count at every step of `llm.generate(prompts)`."""
    seen = FreezeSeen()
    remove = llm.add_observer(seen)
    try:
        llm.generate(prompts, PARAMS)
    finally:
        remove()
    return seen.counts


def test_the_heap_is_frozen_while_generate_runs_and_thawed_after(llm):
    assert gc.get_freeze_count() == 0
    counts = freeze_counts_during(llm, [[1, 2, 3], [4, 5]])
    assert counts and all(c > 0 for c in counts)
    assert gc.get_freeze_count() == 0


def test_a_failing_run_thaws_the_heap_too(llm):
    class Boom:
        def on_step(self, llm, batch, events):
            raise KeyboardInterrupt  # a learner's interrupt in the middle of a step

    remove = llm.add_observer(Boom())
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([1, 2, 3], PARAMS)
    finally:
        remove()
    assert gc.get_freeze_count() == 0
    assert llm.generate([1, 2, 3], PARAMS)[0].token_ids  # and the engine serves on


def test_a_heap_the_caller_froze_stays_frozen(llm):
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        llm.generate([1, 2, 3], PARAMS)
        assert gc.get_freeze_count() > before // 2 > 0  # (a frozen object freed by its refcount leaves the count)
    finally:
        gc.unfreeze()


def test_a_heap_frozen_before_is_frozen_further_while_generate_runs(llm):
    """A freeze the caller made before the run does not keep the run's full collections walking
    everything that came after it: the run freezes those too. Python cannot thaw them apart, so they
    stay frozen after the run, with the caller's freeze."""
    gc.freeze()  # "start-up"
    later = [[i] for i in range(50_000)]  # tracked objects (lists are) that came after that freeze
    try:
        before = gc.get_freeze_count()
        counts = freeze_counts_during(llm, [1, 2, 3])
        assert counts and min(counts) >= before + len(later)
        assert gc.get_freeze_count() >= before + len(later)  # not thawed: the earlier freeze is not ours to undo
    finally:
        gc.unfreeze()
        del later


def test_a_start_up_freeze_of_the_interpreter_is_thawed_with_the_runs(llm, monkeypatch):
    """Python 3.12 starts some processes with a few hundred objects frozen: a run still freezes the heap,
    and thaws it after, those few with it, so the next run's check of the heap walks nothing (had the
    heap stayed frozen, every later generate() would pay for counting it)."""
    from minikv.engine import gc_pause

    gc.freeze()  # "the interpreter's start-up freeze"
    try:
        monkeypatch.setattr(gc_pause, "_START_UP_FROZEN", gc.get_freeze_count())
        later = [[i] for i in range(50_000)]
        before = gc.get_freeze_count()
        counts = freeze_counts_during(llm, [1, 2, 3])
        assert counts and min(counts) >= before + len(later)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_overlapping_runs_thaw_once_the_last_ends():
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with frozen_heap():
            inside.set()
            leave.wait(timeout=10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(timeout=10)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0, "the first run still holds it"
    leave.set()
    t.join()
    assert gc.get_freeze_count() == 0


def test_the_server_loop_keeps_its_start_up_heap_frozen_until_it_stops(llm):
    from minikv.serve.engine_loop import EngineLoop

    seen, ended = [], threading.Event()  # the freeze as the engine thread sees it, at each of its events

    def on_event(ev):
        seen.append((ev.kind, gc.get_freeze_count()))
        if ev.kind in ("end", "failed", "rejected"):
            ended.set()

    loop = EngineLoop(llm).start()
    try:
        loop.submit([1, 2, 3], PARAMS, "t", "r1", on_event)
        assert ended.wait(120), f"the request never ended: {seen}"
    finally:
        loop.stop()
    assert seen and seen[-1][0] == "end" and all(count > 0 for _, count in seen), seen
    assert gc.get_freeze_count() == 0


class Pipe:
    """What the engine process's loop uses of a multiprocessing queue, in this process (`on_put` sees
    every message as the loop sends it)."""

    def __init__(self, on_put=None):
        self.q, self.on_put = queue.Queue(), on_put

    def get(self, timeout=None):
        return self.q.get(timeout=timeout)

    def get_nowait(self):
        return self.q.get_nowait()

    def put(self, msg):
        if self.on_put is not None:
            self.on_put(msg)
        self.q.put(msg)

    pending = 0  # (the core's EventWriter: bytes the pipe has not taken; a queue takes all at once)

    def flush(self):
        return True


def test_the_engine_process_steps_with_its_start_up_heap_frozen_and_thaws_when_it_stops():
    """The server's EngineCore process (minikv/serve/core_process.py) freezes what lived once its engine
    was built, as generate() does: no full collection walks the model between its steps. Its loop runs
    here, in this thread, on queues of this process."""
    from minikv.engine.core import EngineRequest
    from minikv.serve.core_process import _core_loop

    commands, seen = Pipe(), []

    def sent(msg):
        if msg[0] == "events":
            seen.append(gc.get_freeze_count())
            if any(e[4] is not None for e in msg[1]):  # a finish reason: the request is done, stop the loop
                commands.put(("stop",))

    results = Pipe(on_put=sent)
    commands.put(("add", EngineRequest([1, 2, 3], PARAMS, "r1", None, None, None)))
    assert gc.get_freeze_count() == 0
    watchdog = threading.Timer(120, commands.put, [("stop",)])  # whatever goes wrong, the loop ends
    watchdog.start()
    try:
        _core_loop("tiny-random", dict(kv_backend="paged", block_size=4, num_blocks=32), commands, results, True)
    finally:
        watchdog.cancel()
    assert [m[1][0][0] for m in results.q.queue if m[0] == "answers"] == ["accepted"]
    assert seen and all(count > 0 for count in seen), seen
    assert [m[0] for m in list(results.q.queue)][-1] == "stopped"
    assert gc.get_freeze_count() == 0


class Node:
    def __init__(self):
        self.other = None


def test_refreeze_collects_the_runs_garbage_and_freezes_what_survived_until_the_run_ends():
    import weakref

    from minikv.engine.gc_pause import refreeze

    assert refreeze() is False and gc.get_freeze_count() == 0  # outside a run: nothing to add to
    with frozen_heap():
        kept = [[i] for i in range(2000)]  # what a run keeps (a cache's entries): tracked containers
        a, b = Node(), Node()
        a.other, b.other = b, a  # garbage the run made: a cycle only the collector frees
        dead = weakref.ref(a)
        del a, b
        assert refreeze() is True
        assert dead() is None, "the cycle was frozen instead of collected"
        kept_ids = {id(x) for x in kept}  # (the frozen count itself moves as other threads free frozen objects)
        walked = sum(id(o) in kept_ids for o in gc.get_objects())
        assert walked == 0, f"{walked} of the run's {len(kept)} survivors are left for a full collection to walk"
    assert gc.get_freeze_count() == 0, "the run's end thaws the refrozen objects too"
    assert len(kept) == 2000


def test_the_engine_process_refreezes_when_it_falls_idle(monkeypatch):
    """After its last live request the engine process moves what survived into the frozen heap (its prefix
    cache's entries would otherwise be walked by every full collection of the next burst)."""
    from minikv.engine.core import EngineRequest
    from minikv.serve import core_process

    commands, calls = Pipe(), []

    def refreeze():  # the loop fell idle: record, then end the loop
        calls.append(sum(1 for m in results.q.queue if m[0] == "events"))
        commands.put(("stop",))
        return True

    monkeypatch.setattr(core_process, "refreeze", refreeze)
    results = Pipe()
    commands.put(("add", EngineRequest([1, 2, 3], PARAMS, "r1", None, None, None)))
    watchdog = threading.Timer(120, commands.put, [("stop",)])
    watchdog.start()
    try:
        core_process._core_loop("tiny-random", dict(kv_backend="paged", block_size=4, num_blocks=32,
                                                    prefix_caching="hash"), commands, results, True, own_process=True)
    finally:
        watchdog.cancel()
    assert len(calls) == 1 and calls[0] > 0, "refrozen once, after the request's steps"
    finished = [e for m in results.q.queue if m[0] == "events" for e in m[1] if e[4] is not None]
    assert finished, "the request ended before the core fell idle"
    assert [m[0] for m in results.q.queue][-1] == "stopped"


def test_what_the_engine_process_refreezes_when_idle_holds_no_finished_request():
    """A refreeze at idle must not freeze a finished request that something still points at (the last
    step's sequences, say): a Sequence is its own root, a cycle only the collector frees, so once frozen
    and then let go it would never be freed while the process runs: a leak per idle moment."""
    import weakref

    from minikv.engine.core import EngineCore, EngineRequest
    from minikv.engine.gc_pause import refreeze as real_refreeze
    from minikv.serve import core_process

    commands, alive, seen = Pipe(), weakref.WeakSet(), []
    add = EngineCore.add

    def tracked_add(self, request):
        seq = add(self, request)
        alive.add(seq)
        return seq

    def refreeze():  # the loop fell idle: refreeze for real, count the requests still alive, go on
        froze = real_refreeze()
        gc.collect()
        seen.append(len(alive))
        commands.put(("add", EngineRequest([4, 5, 6], PARAMS, f"r{len(seen)}", None, None, None))
                     if len(seen) < 4 else ("stop",))
        return froze

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(EngineCore, "add", tracked_add)
        mp_.setattr(core_process, "refreeze", refreeze)
        commands.put(("add", EngineRequest([1, 2, 3], PARAMS, "r0", None, None, None)))
        watchdog = threading.Timer(120, commands.put, [("stop",)])
        watchdog.start()
        try:
            core_process._core_loop("tiny-random", dict(kv_backend="paged", block_size=4, num_blocks=32,
                                                        prefix_caching="hash"), commands, Pipe(), True,
                                    own_process=True)
        finally:
            watchdog.cancel()
    assert seen == [0, 0, 0, 0], f"finished requests still alive (frozen) at each idle moment: {seen}"
    assert gc.get_freeze_count() == 0
