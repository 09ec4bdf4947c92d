"""A step is all or nothing for the pool. A fault raised at any call into the model runner, the block
manager (and its allocator), the swap space or the prefix cache, in the middle of real traces
(recompute and swap preemption, prefix caching, n > 1 samples, beams), leaves the engine sound:

    the pool checks out (refcounts == block tables), nothing is leaked, no request is left half-way,
    and the next generate gives the same tokens as a fresh engine.

The fault is a KeyboardInterrupt, the everyday case: a learner pressing stop in a notebook."""
import random
import zlib

import pytest

from minikv import LLM, SamplingParams


class Fault(KeyboardInterrupt):
    """What the injector raises."""


class Injector:
    """Counts every call into the engine's parts and raises Fault at call number `fire_at` (never if None)."""

    def __init__(self, llm: LLM, fire_at: int | None):
        self.fire_at, self.calls, self.patched = fire_at, 0, []
        parts = [llm.runner, llm.block_manager, llm.block_manager.allocator, llm.scheduler.swap, llm.prefix_cache]
        for obj in (p for p in parts if p is not None):
            for name in dir(type(obj)):
                if name.startswith("__") or not callable(getattr(type(obj), name, None)):
                    continue
                if isinstance(getattr(type(obj), name), (staticmethod, classmethod, property, type)):
                    continue
                self._wrap(obj, name)

    def _wrap(self, obj, name: str) -> None:
        original = getattr(obj, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fire_at:
                raise Fault(f"injected at call {self.calls}: {type(obj).__name__}.{name}")
            return original(*args, **kwargs)

        setattr(obj, name, call)
        self.patched.append((obj, name))

    def remove(self) -> None:
        for obj, name in self.patched:
            vars(obj).pop(name, None)


PROMPTS = [[(11 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate((9, 17, 6, 13))]


def workload(llm: LLM) -> list:
    params = [SamplingParams(max_tokens=7, n=2, temperature=1.0, seed=10 + i, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=7, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    beams = [c.token_ids for c in llm.beam_search(PROMPTS[1], beam_width=2, max_tokens=5)[0].outputs]
    return outs + [beams]


def engine(preemption: str, prefix_caching: str | None) -> LLM:
    # a pool small enough that the 6 sequences preempt each other
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=14, max_num_seqs=6,
               max_num_batched_tokens=16, preemption=preemption, prefix_caching=prefix_caching)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [None, "hash", "radix"])
def test_a_fault_at_any_call_leaves_the_engine_sound(preemption, prefix_caching):
    fresh = workload(engine(preemption, prefix_caching))
    llm = engine(preemption, prefix_caching)
    assert workload(llm) == fresh
    assert llm.stats()["num_preemptions"] > 0 or llm.scheduler.num_preemptions > 0
    counter = Injector(llm, fire_at=None)  # counted on a warm run: every injected run starts warm
    assert workload(llm) == fresh
    counter.remove()
    total = counter.calls
    rng = random.Random(zlib.crc32(f"{preemption} {prefix_caching}".encode()))
    points = sorted({1, 2, total} | set(rng.sample(range(3, total), 24)))
    faults = 0
    for fire_at in points:
        injector = Injector(llm, fire_at)
        try:  # a warm prefix cache makes fewer calls: a late fault point may not be reached
            assert workload(llm) == fresh
        except Fault:
            faults += 1
        injector.remove()
        bm = llm.block_manager
        bm.check(llm.scheduler.all_sequences())
        assert not llm.has_unfinished(), f"fault at call {fire_at}: requests left behind"
        assert bm.num_free_blocks == bm.num_blocks, f"fault at call {fire_at}: {bm.num_used_blocks} blocks leaked"
        if llm.scheduler.swap is not None:
            assert llm.scheduler.swap.num_free_blocks == llm.scheduler.swap.allocator.num_blocks
        assert workload(llm) == fresh, f"fault at call {fire_at}: the next run differs from a fresh engine's"
    assert faults >= len(points) - 2, f"only {faults} of {len(points)} fault points were reached"


def test_a_fault_inside_a_stream_ends_the_stream_and_the_engine_serves_on():
    llm = engine("recompute", "hash")
    want = [o.token_ids for o in engine("recompute", "hash").generate(PROMPTS, SamplingParams(max_tokens=6))]
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=6))
    next(stream)
    injector = Injector(llm, fire_at=3)
    with pytest.raises(Fault):
        list(stream)
    injector.remove()
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6))] == want


def test_requests_of_another_caller_survive_a_fault_and_finish_right():
    # a fault in a step driven for caller A: caller B's queued request is recomputed, not lost or corrupted
    llm = engine("recompute", None)
    want = engine("recompute", None).generate([PROMPTS[2]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    other = llm.add_request(PROMPTS[2], SamplingParams(max_tokens=6, ignore_eos=True))
    injector = Injector(llm, fire_at=40)
    with pytest.raises(Fault):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    injector.remove()
    assert not other.is_finished and llm.has_unfinished()
    while llm.has_unfinished():
        llm.step()
    assert other.output_token_ids == want.token_ids
    llm.block_manager.check([])


def test_a_request_whose_sampling_fails_ends_alone_and_the_engine_serves_on(monkeypatch):
    import minikv.engine.core as llm_module

    def failing(real):
        def sample(logits, params, generators):  # a request with top_k=7 cannot be sampled (a stand-in fault)
            if any(p.top_k == 7 for p in params):
                raise FloatingPointError("probabilities are nan")
            return real(logits, params, generators)
        return sample

    for name in ("sample", "sample_on_device"):  # the plain step's sampler and the overlapped step's
        monkeypatch.setattr(llm_module, name, failing(getattr(llm_module, name)))
    llm = engine("recompute", "hash")
    want = engine("recompute", "hash").generate(PROMPTS[:1], SamplingParams(max_tokens=5, n=2, temperature=1.0,
                                                                            seed=3))[0]
    bad, good = SamplingParams(max_tokens=5, top_k=7, temperature=1.0), SamplingParams(max_tokens=5, ignore_eos=True)
    events = list(llm.stream(PROMPTS[2:4], [bad, good]))
    bad_events = [e for e in events if e.index == 0]
    assert len(bad_events) == 1 and bad_events[0].finished and bad_events[0].finish_reason == "error"
    assert [e.finish_reason for e in events if e.index == 1][-1] == "length"
    with pytest.raises(RuntimeError, match="failed \\(sampling failed: FloatingPointError: probabilities are nan\\)"):
        llm.generate(PROMPTS[2:4], [bad, good])
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    got = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3))[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
