"""Python's cyclic garbage collector kept off what already lives while the engine runs a batch.

A full (generation 2) collection walks every tracked object of the process: the model's modules and
parameters, the tokenizer, transformers' registries, every request. With SmolLM2 loaded that is
~209,000 objects and 50-60 ms on one core of the course machine, and the allocations of a run
trigger such collections at moments nobody chose: on a GPU, where a decode step's host work is a few
milliseconds and the device waits for it, one pause costs about ten steps. (vLLM and SGLang freeze
the heap after start-up for the same reason.)

`frozen_heap()` moves the objects alive at its start into the collector's permanent generation
(`gc.freeze()`, O(1)) and back when it ends (`gc.unfreeze()`): meanwhile the garbage of the run is
still collected (young objects), but a full collection no longer walks the old ones. Nothing is lost:
a cycle among the old objects that became garbage during the run is collected after it, as usual.

Only the outermost run freezes (threads, nested generate calls and the server loop share one
freeze), and the last to end thaws. Some interpreters start with a few hundred objects frozen (the GPU
hosts' Python 3.12 does, even under -I): those are thawed with the run's. A heap its caller froze
beyond them is frozen further while the run lasts (left alone, every full collection of the run walks
everything that came after that freeze: what that cost a server on a GPU host,
benchmarks/NOTES_step_profile.md), and stays frozen after it: Python cannot thaw part of the frozen
objects, and the caller's freeze is not ours to undo. Knowing which case it is costs a walk over the
frozen objects (Python has no cheaper way to count them): nothing while the heap is ours, milliseconds
per run behind a large freeze of the caller's.

Meanwhile a frozen object is still freed by its reference count,
only a frozen *cycle* waits for the thaw: an engine holds no cycle back to itself (its scheduler and
prefix cache call it through weak references), so one deleted while another run holds the freeze is
freed at once. A cycle of your own around an engine (an observer that keeps the engine, say) is
garbage the collector finds only after the last run ends; break it, or `close()` the engine, which
gives its memory back whatever still points at it.
"""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0  # runs inside frozen_heap() now (threads, nested generate calls); the first freezes
_thaw = False  # whether the last run to end thaws: nobody but the interpreter froze before the first began
_START_UP_FROZEN = gc.get_freeze_count()  # what the interpreter froze before this module was imported


@contextmanager
def frozen_heap() -> Iterator[None]:
    global _holders, _thaw
    with _lock:
        _holders += 1
        if _holders == 1 and gc.isenabled():  # a collector turned off is left alone
            _thaw = gc.get_freeze_count() <= _START_UP_FROZEN  # (beyond them: the caller's, not thawed by us)
            gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _thaw:
                gc.unfreeze()
                _thaw = False


def refreeze() -> bool:
    """Inside a run that holds the freeze (`frozen_heap`): collect the garbage made since it began, then
    freeze what survived as well. For a run that lasts for good, the server's engine process: what it keeps
    from request to request (a prefix cache's entry per cached block, the spans of its index) would
    otherwise stay young, and every full collection of the run would walk all of it: a pause that grows
    with the traffic served (23-32 ms a collection in a burst after two loads on the GPU host,
    benchmarks/NOTES_step_profile.md). Called when the run falls idle, after the last live request:
    nothing of a request is then alive to be frozen, and the collection costs what the next one would
    have. Garbage made later by what it froze (a cycle among them) waits for the thaw, as with the first
    freeze. So only where the run owns the process: in one that other engines share (a notebook's, a
    test's) it would freeze theirs too, and an engine stopped there would wait for the last run's end to
    be freed. Returns whether it froze (False outside a run, or with the collector off)."""
    with _lock:
        if _holders == 0 or not gc.isenabled():
            return False
        gc.collect()
        gc.freeze()
        return True
