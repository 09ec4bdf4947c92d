"""An engine gives its memory back: `close()` frees every tensor it allocated, and `del llm` frees the
engine itself, at once (no reference cycle through its callbacks), even while another engine's run
holds the frozen heap (minikv/engine/gc_pause.py)."""
import gc
import threading
import weakref

import pytest
import torch

from minikv import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPTS = [list(range(1, 14)), list(range(1, 10)) + [40, 41, 42]]  # a shared prefix of 9 tokens
PAGED = dict(kv_backend="paged", block_size=4, num_blocks=64)
ENGINES = {
    "contiguous": dict(kv_backend="contiguous"),
    "paged": PAGED,
    "paged-swap": dict(PAGED, preemption="swap"),
    "prefix-hash": dict(PAGED, prefix_caching="hash"),
    "prefix-radix": dict(PAGED, prefix_caching="radix"),
    "offload-cpu-disk": dict(PAGED, num_blocks=16, prefix_caching="hash", kv_offload_cpu_bytes=2**20),  # + a dir
}


def build(name: str, tmp_path) -> LLM:
    options = dict(ENGINES[name])
    if name == "offload-cpu-disk":
        options["kv_offload_dir"] = str(tmp_path)
    return LLM("tiny-random", **options)


def run_everything(llm: LLM) -> None:
    """generate, stream, and on a paged pool parallel samples (forks) and beam search."""
    llm.generate(PROMPTS, PARAMS)
    for i in range(1, 7):  # other prompts, one at a time: a small pool evicts (down to the offload tiers)
        llm.generate([50 * i + j for j in range(13)], PARAMS)
    list(llm.stream(PROMPTS[0], PARAMS))
    if llm.is_paged:
        llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, n=3, temperature=1.0, ignore_eos=True))
        llm.beam_search(PROMPTS[0], beam_width=2, max_tokens=3)


class collector_off:
    """No collection while inside: what dies here dies by its reference count alone (no cycle)."""

    def __enter__(self):
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.was:
            gc.enable()


def pool_tensor(llm: LLM) -> torch.Tensor:
    return llm.backend.pool.k_cache


@pytest.mark.parametrize("name", list(ENGINES))
def test_a_deleted_engine_is_freed_by_its_refcount_after_every_kind_of_run(name, tmp_path):
    llm = build(name, tmp_path)
    run_everything(llm)
    engine, k_cache = weakref.ref(llm), weakref.ref(pool_tensor(llm))
    with collector_off():
        del llm
        assert engine() is None, "something still points at the deleted engine (a cycle through a callback?)"
        assert k_cache() is None, "the deleted engine's KV pool is still alive"


@pytest.mark.parametrize("name", list(ENGINES))
def test_close_gives_back_every_tensor_the_engine_allocated_and_is_idempotent(name, tmp_path):
    llm = build(name, tmp_path)
    run_everything(llm)
    k_cache = weakref.ref(pool_tensor(llm))
    swap = llm.scheduler.swap if llm.is_paged else None
    swap_planes = [weakref.ref(p) for p in swap.planes] if swap is not None else []
    store = llm.offload_store
    cpu_slab = [weakref.ref(t) for t in store.cpu.slab] if store is not None else []
    assert store is None or cpu_slab, "the CPU tier held no block: the test would prove nothing"
    llm.close()
    assert k_cache() is None and llm.backend.pool.k_cache is None
    assert all(r() is None for r in swap_planes + cpu_slab)
    llm.close()  # idempotent
    assert llm.stats()["kv_backend"] == ENGINES[name]["kv_backend"]  # stats still answer
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate(PROMPTS[0], PARAMS)


def test_closing_one_engine_of_shared_weights_leaves_its_siblings_serving():
    parent = LLM("tiny-random", **PAGED)
    want = parent.generate(PROMPTS, PARAMS)
    child, sibling = parent.derive(), parent.derive(prefix_caching="hash")
    with child:
        child.generate(PROMPTS, PARAMS)
    assert child.loaded is parent.loaded  # the weights are shared, not released by the child's close
    assert [o.token_ids for o in sibling.generate(PROMPTS, PARAMS)] == [o.token_ids for o in want]
    parent.close()
    assert [o.token_ids for o in sibling.generate(PROMPTS, PARAMS)] == [o.token_ids for o in want]
    weights = weakref.ref(next(parent.model.parameters()))
    del parent, child
    assert weights() is not None, "the sibling still serves on these weights"
    with collector_off():
        del sibling
        assert weights() is None, "the last engine on the weights is gone: they must go too"


def test_a_run_holding_the_frozen_heap_does_not_keep_an_older_deleted_engine_alive():
    if gc.get_freeze_count():  # some import froze objects already: frozen_heap leaves such a heap alone
        pytest.skip(f"{gc.get_freeze_count()} objects were frozen before the test; engines would not be")
    older = LLM("tiny-random", **dict(PAGED, prefix_caching="hash"))
    older.generate(PROMPTS, PARAMS)
    inside, leave = threading.Event(), threading.Event()

    class Hold:
        def on_step(self, llm, batch, events):
            inside.set()
            leave.wait(timeout=30)

    runner = LLM("tiny-random", **PAGED)
    runner.add_observer(Hold())
    t = threading.Thread(target=runner.generate, args=(PROMPTS[0], SamplingParams(max_tokens=1)))
    t.start()
    try:
        assert inside.wait(timeout=30)
        assert gc.get_freeze_count() > 0, "the other run must hold the frozen heap, or the test proves nothing"
        older.generate(PROMPTS, PARAMS)  # a run of its own while the heap is frozen
        engine, k_cache = weakref.ref(older), weakref.ref(pool_tensor(older))
        del older
        gc.collect()
        assert engine() is None and k_cache() is None, "a frozen heap kept the deleted engine"
        assert gc.get_freeze_count() > 0
    finally:
        leave.set()
        t.join(timeout=60)
    assert not t.is_alive(), "the other run did not finish"
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("how", ["close", "del"])
def test_an_engine_built_after_another_was_closed_or_deleted_gets_the_same_pool(how):
    """On a CPU, kv_cache_memory sizes the pool by itself (free memory is not read); on a GPU the
    pool is fitted to the free memory, which the first engine must have given back."""
    first = LLM("tiny-random", kv_backend="paged", block_size=4, kv_cache_memory=2**20)
    first.generate(PROMPTS, PARAMS)
    num_blocks = first.stats()["num_blocks"]
    if how == "close":
        first.close()
    else:
        del first
    second = LLM("tiny-random", kv_backend="paged", block_size=4, kv_cache_memory=2**20)
    assert second.stats()["num_blocks"] == num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pool is fitted to free memory on a GPU only")
@pytest.mark.parametrize("how", ["close", "del"])
def test_on_a_gpu_the_next_engine_fitted_to_free_memory_gets_as_many_blocks(how):
    first = LLM("tiny-random", kv_backend="paged", device="cuda")
    first.generate(PROMPTS, PARAMS)
    num_blocks = first.stats()["num_blocks"]
    if how == "close":
        first.close()  # the engine stays, its pool goes
    else:
        del first
    second = LLM("tiny-random", kv_backend="paged", device="cuda")
    assert second.stats()["num_blocks"] >= num_blocks * 0.98, (second.stats()["num_blocks"], num_blocks)


def test_an_engine_served_by_an_engine_loop_is_freed_once_the_loop_stopped():
    from minikv.serve.engine_loop import EngineLoop

    llm = LLM("tiny-random", **PAGED)
    loop = EngineLoop(llm).start()
    loop.stop()
    engine = weakref.ref(llm)
    with collector_off():
        del llm, loop
        assert engine() is None, "the stopped loop (an engine observer) still holds the engine"


def test_close_releases_the_weights_it_loaded_unless_another_open_engine_shares_them():
    owner = LLM("tiny-random", **PAGED)
    child = owner.derive()
    owner.close(release_weights=True)  # the child still serves on them: they stay
    assert not owner.loaded.released
    assert child.generate(PROMPTS[0], PARAMS)[0].token_ids
    child.close(release_weights=True)  # a derived engine never releases what it did not load
    assert not owner.loaded.released
    alone = LLM("tiny-random", **PAGED)
    alone.close(release_weights=True)
    assert alone.loaded.released and next(alone.model.parameters()).device.type == "meta"
    with pytest.raises(ValueError, match="released when the engine that loaded them was closed"):
        alone.derive()
    kept = LLM("tiny-random", device="cpu", **PAGED)
    kept.close()  # on a CPU the default keeps them: later engines may still be built on kept.loaded
    assert not kept.loaded.released and kept.derive().generate(PROMPTS[0], PARAMS)[0].token_ids
    if torch.cuda.is_available():  # on a GPU the default gives them back
        gone = LLM("tiny-random", device="cuda", **PAGED)
        gone.close()
        assert gone.loaded.released
    with pytest.raises(ValueError, match="release_weights must be"):
        kept.close(release_weights="yes")
