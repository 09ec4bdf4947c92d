"""Rung 9, the tiered prefix store: evicted blocks spill to CPU memory and disk, come back on a hit,
survive a restart, and the outputs stay exactly those of the engine without tiers."""
import threading
from pathlib import Path

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.cache.prefix.hash_chain import block_hashes
from minikv.cache.tiers.identity import store_key
from minikv.model.loader import LoadedModel

from engine_checks import checked

BS = 4
SYSTEM = [11, 27, 301, 45, 9, 88, 120, 7, 64, 33, 250, 19]  # 3 blocks every user shares
POOL = dict(kv_backend="paged", block_size=BS, num_blocks=16, max_num_seqs=3, prefix_caching="hash")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=40, seed=5, n=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (tests/conftest.py)


@pytest.fixture(scope="module")
def base():
    return LLM("tiny-random", **POOL)


def question(user: int, turn: int) -> list[int]:
    return [(31 * user + 7 * turn + j) % 500 + 1 for j in range(5)]


def chat(llm: LLM, params: SamplingParams, users: int = 3, turns: int = 3) -> list[list[list[int]]]:
    """Users chat at once, turn after turn: each prompt is the whole history (system, questions,
    answers). Returns every sample's tokens, request by request."""
    histories = [SYSTEM + question(u, 0) for u in range(users)]
    outs = []
    for turn in range(1, turns + 1):
        res = llm.generate([{"prompt_token_ids": h} for h in histories], params)
        for u, r in enumerate(res):
            outs.append([c.token_ids for c in r.outputs])
            histories[u] = histories[u] + r.outputs[0].token_ids + question(u, turn)
    return outs


_reference: dict = {}


def reference(base: LLM, preemption: str, params: SamplingParams):
    """The same chat without tiers (computed once per case)."""
    key = (preemption, params.n)
    if key not in _reference:
        off = base.derive(preemption=preemption)
        _reference[key] = (chat(off, params), off.stats()["num_preemptions"])
    return _reference[key]


def tier_options(tiers: str, tmp_path: Path) -> dict:
    opts = {}
    if "cpu" in tiers:
        opts["kv_offload_cpu_bytes"] = 2**20
    if "disk" in tiers:
        opts["kv_offload_dir"] = str(tmp_path / "kv")
    return opts


@pytest.mark.parametrize("tiers, preemption, params", [
    ("cpu", "recompute", GREEDY), ("disk", "swap", SEEDED),
    ("cpu+disk", "swap", GREEDY), ("cpu+disk", "recompute", SEEDED)],
    ids=["cpu-recompute-greedy", "disk-swap-seeded-fork", "cpu+disk-swap-greedy", "cpu+disk-recompute-seeded-fork"])
def test_task_9_outputs_identical_with_tiers_on_and_off_through_eviction_reload_and_restart(
        base, tmp_path, tiers, preemption, params):
    want, preemptions = reference(base, preemption, params)
    assert preemptions > 0, "the workload must preempt, or the test proves nothing about preemption"
    with checked(base.derive(preemption=preemption, **tier_options(tiers, tmp_path))) as llm:
        assert chat(llm, params) == want
        pc = llm.stats()["prefix_cache"]
    loaded = sum(v for k, v in pc["hits_by_tier"].items() if k != "pool")
    assert pc["evicted_blocks"] > 0 and loaded > 0, f"no block came back from a tier: {pc['hits_by_tier']}"
    if "disk" in tiers:  # a fresh engine on the warm directory: hits from disk, same outputs
        with checked(base.derive(preemption=preemption, kv_offload_dir=str(tmp_path / "kv"))) as again:
            assert chat(again, params) == want
            assert again.stats()["prefix_cache"]["hits_by_tier"].get("disk", 0) > 0


@pytest.mark.parametrize("changes", [{"kv_cache_dtype": "int8"}, {"sliding_window": 12, "sink_tokens": 4}],
                         ids=["int8-pool", "sliding-window"])
def test_tiers_keep_outputs_identical_on_a_quantized_pool_and_under_a_sliding_window(base, tmp_path, changes):
    """Blocks that go down a tier and come back carry everything the pool holds for them (an int8 pool's
    scales too), and a window's given-back blocks never confuse the store."""
    off = base.derive(preemption="recompute", **changes)
    want = chat(off, GREEDY)
    with checked(base.derive(preemption="recompute", kv_offload_cpu_bytes=2**20, kv_offload_dir=str(tmp_path / "kv"),
                             **changes)) as llm:
        assert chat(llm, GREEDY) == want
        pc = llm.stats()["prefix_cache"]
    assert sum(v for k, v in pc["hits_by_tier"].items() if k != "pool") > 0, pc["hits_by_tier"]


def test_close_writes_every_queued_block_and_the_engine_then_refuses_requests(base, tmp_path):
    llm = base.derive(kv_offload_dir=str(tmp_path))
    chat(llm, GREEDY, users=2, turns=1)
    llm.close()
    disk = llm.offload_store.disk
    files = list(disk.dir.glob("*.kv"))
    assert disk.pending == {} and len(files) == disk.num_writes > 0
    assert not list(disk.dir.glob("*.tmp")) and not disk._thread
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([1, 2, 3], GREEDY)


def test_a_block_is_written_through_once_computed_not_only_when_evicted(base, tmp_path):
    with base.derive(num_blocks=64, kv_offload_dir=str(tmp_path)) as llm:
        llm.generate({"prompt_token_ids": SYSTEM + question(0, 0)}, GREEDY)
        llm.offload_store.flush()
        assert llm.stats()["prefix_cache"]["evicted_blocks"] == 0
        assert len(list(llm.offload_store.disk.dir.glob("*.kv"))) == (len(SYSTEM) + 5 + 8 - 1) // BS


# ---- loads from disk run beside the other requests --------------------------------------------------
DOC = {"prompt_token_ids": SYSTEM + question(0, 0)}  # 17 tokens: 4 full blocks written through
TALKER = {"prompt_token_ids": question(5, 1) * 2}
LONG = SamplingParams(max_tokens=12, ignore_eos=True)


def warm_directory(base: LLM, path: Path) -> list[int]:
    """A first engine computes DOC and writes its blocks to `path`; returns its tokens."""
    with base.derive(num_blocks=64, kv_offload_dir=str(path)) as first:
        return first.generate(DOC, GREEDY)[0].token_ids


def gate_reads(llm: LLM, fail: bool = False) -> threading.Event:
    """Every disk read of `llm` waits until the returned event is set (or raises, with `fail`)."""
    gate, disk = threading.Event(), llm.offload_store.disk
    read = disk.read

    def gated(key):
        if fail:
            raise OSError("the disk went away")
        gate.wait(timeout=20)
        return read(key)

    disk.read = gated
    return gate


def test_a_running_decode_keeps_getting_tokens_while_another_requests_prefix_loads_from_disk(base, tmp_path):
    want_doc = warm_directory(base, tmp_path)
    want_talk = base.generate(TALKER, LONG)[0].token_ids
    with checked(base.derive(num_blocks=64, kv_offload_dir=str(tmp_path))) as llm:
        gate = gate_reads(llm)
        talk = llm.add_request(TALKER, LONG)
        llm.step()  # its prompt: the first token
        reader = llm.add_request(DOC, GREEDY)
        for step in range(4):  # DOC's reads are held: TALKER decodes on, one token a step
            llm.step()
            assert len(talk.output_token_ids) == 2 + step and reader in llm.scheduler.loading
        offload = llm.stats()["prefix_cache"]["offload"]
        assert offload["loading"] == 1 and offload["async_loads"] == 1 and not reader.output_token_ids
        gate.set()
        while llm.has_unfinished():
            llm.step()
        pc = llm.stats()["prefix_cache"]
        assert llm.block_manager.num_refs == 0 and pc["offload"]["loading"] == 0  # all back after the drain
    assert talk.output_token_ids == want_talk and reader.output_token_ids == want_doc
    assert pc["hits_by_tier"]["disk"] == 4 * BS and pc["offload"]["load_failures"] == 0


def test_a_request_aborted_while_its_prefix_loads_gives_every_block_back(base, tmp_path):
    want_doc = warm_directory(base, tmp_path)
    with checked(base.derive(num_blocks=64, kv_offload_dir=str(tmp_path))) as llm:
        gate = gate_reads(llm)
        talk = llm.add_request(TALKER, LONG)
        llm.step()
        reader = llm.add_request(DOC, GREEDY)
        llm.step()
        assert reader in llm.scheduler.loading and llm.block_manager.num_refs > len(talk.block_table)
        llm.abort(reader)
        assert llm.block_manager.num_refs == len(talk.block_table) and not llm.scheduler.loading
        assert llm.stats()["prefix_cache"]["offload"]["loading"] == 0
        gate.set()  # its reads finish unseen
        while llm.has_unfinished():
            llm.step()
        assert llm.block_manager.num_refs == 0
        assert llm.generate(DOC, GREEDY)[0].token_ids == want_doc  # and the next request loads it whole
        assert llm.stats()["prefix_cache"]["hits_by_tier"]["disk"] == 4 * BS


def test_a_sequence_swapped_out_while_a_load_holds_the_pool_comes_back_once_the_load_gives_way(base, tmp_path):
    """The talker needs a block while DOC's reads hold the rest of the pool: it swaps itself out and the
    step is empty, so the scheduler waits for the load. The loaded DOC may not pass the swapped talker and
    gives its blocks back at the end of that pass, after the talker was found not to fit: the scheduler
    must look again (it had stopped with both waiting: 'could run nothing this step')."""
    want_doc = warm_directory(base, tmp_path)
    want_talk = base.generate(TALKER, LONG)[0].token_ids
    with checked(base.derive(num_blocks=8, preemption="swap", kv_offload_dir=str(tmp_path))) as llm:
        gate = gate_reads(llm)
        wait = llm.block_manager.wait_for_load

        def open_then_wait(seq):  # the reads finish only once the scheduler waits for them: one interleaving
            gate.set()
            wait(seq)

        llm.block_manager.wait_for_load = open_then_wait
        talk = llm.add_request(TALKER, LONG)
        llm.step()
        reader = llm.add_request(DOC, GREEDY)
        while llm.has_unfinished():
            llm.step()
        assert llm.stats()["num_swaps"] >= 1 and gate.is_set()
    assert talk.output_token_ids == want_talk and reader.output_token_ids == want_doc


@pytest.mark.parametrize("how", ["raises", "hangs"])
def test_a_disk_read_that_fails_or_hangs_ends_the_hit_and_the_rest_is_computed(base, tmp_path, monkeypatch, how):
    from minikv.cache.tiers import offload

    want_doc = warm_directory(base, tmp_path)
    monkeypatch.setattr(offload, "READ_TIMEOUT_S", 0.5)
    with checked(base.derive(num_blocks=64, kv_offload_dir=str(tmp_path))) as llm:
        gate = gate_reads(llm, fail=how == "raises")
        try:
            assert llm.generate(DOC, GREEDY)[0].token_ids == want_doc
        finally:
            gate.set()
        pc = llm.stats()["prefix_cache"]
    assert pc["offload"]["load_failures"] == 1 and pc["offload"]["blocks_in"] == 0 and pc["hits"] == 0
    assert pc["offload"]["loading"] == 0 and llm.block_manager.num_refs == 0


def test_a_load_mixing_cpu_and_disk_blocks_puts_each_block_in_its_place_and_stops_at_a_bad_file(tmp_path):
    """Blocks 0 and 2 in the CPU tier, 1 and 3 on disk only: one load, each block where it belongs; then
    block 1's file damaged: block 0 alone comes back."""
    from minikv.cache.blocks.pool import KVPool
    from minikv.cache.prefix.hash_chain import HashChainCache
    from minikv.cache.tiers.block_file import file_bytes
    from minikv.cache.tiers.cpu import CpuTier
    from minikv.cache.tiers.disk import DiskTier
    from minikv.cache.tiers.offload import Offload
    from minikv.cache.tiers.tiered import TieredStore

    pool = KVPool(2, 8, BS, 2, 8, torch.float32, "cpu")
    for plane in pool.planes:
        plane.copy_(torch.randn(plane.shape, generator=torch.Generator().manual_seed(1)))
    identity = "ab" * 32
    store = TieredStore(CpuTier(4 * pool.block_bytes, pool.block_bytes),
                        DiskTier(tmp_path, identity, 8 * file_bytes(pool.block_bytes), pool.block_bytes))
    offload = Offload(pool, HashChainCache(BS), store, identity)
    keys = [offload.key(bytes([j]) * 32) for j in range(4)]
    want = pool.read_blocks([0, 1, 2, 3])
    store.put_many([keys[0], keys[2]], tuple(t[:, [0, 2]] for t in want))
    store.persist_many([keys[1], keys[3]], tuple(t[:, [1, 3]] for t in want))
    store.flush()
    assert [store.locate(k) for k in keys] == ["cpu", "disk", "cpu", "disk"]
    assert offload.load(keys, [4, 5, 6, 7]) == 4
    assert all(torch.equal(a, b) for a, b in zip(pool.read_blocks([4, 5, 6, 7]), want))
    assert offload.stats()["hits_by_tier"] == {"cpu": 2 * BS, "disk": 2 * BS} and offload.stats()["loading"] == 0

    path = store.disk.path(keys[1])
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    assert offload.load(keys, [7, 6, 5, 4]) == 1 and offload.load_failures == 1
    assert all(torch.equal(a[:, 0], b[:, 0]) for a, b in zip(pool.read_blocks([7]), want))
    store.close()


# ---- keys: another model, another format, another tenant never hits -------------------------------
def run_warm(base: LLM, tmp_path: Path, **changes) -> dict:
    """Fill the directory with one engine, then run the same prompt on an engine with `changes`."""
    prompt = {"prompt_token_ids": SYSTEM + question(0, 0)}
    with base.derive(kv_offload_dir=str(tmp_path)) as first:
        first.generate(prompt, GREEDY)
    prompt = {**prompt, **changes.pop("prompt", {})}
    with base.derive(kv_offload_dir=str(tmp_path), **changes) as second:
        second.generate(prompt, GREEDY)
        return second.stats()["prefix_cache"]


def other_weights(base: LLM) -> LoadedModel:
    import copy

    model = copy.deepcopy(base.loaded.model)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3  # one weight of one tensor
    return LoadedModel(model, base.loaded.config, base.loaded.tokenizer, base.loaded.source)


def test_the_same_model_and_format_hits_the_warm_directory(base, tmp_path):
    assert run_warm(base, tmp_path)["hits_by_tier"]["disk"] == 4 * BS


@pytest.mark.parametrize("change", ["weights", "dtype", "kv_layout", "block_size", "cache_salt", "kv_cache_dtype"])
def test_another_model_format_or_tenant_never_hits(base, tmp_path, change):
    prompt = {"prompt_token_ids": SYSTEM + question(0, 0)}
    first = {"dtype": LLM("tiny-random", **POOL, kv_offload_dir=str(tmp_path))}.get(change)
    first = first or base.derive(kv_offload_dir=str(tmp_path))
    with first:
        first.generate(prompt, GREEDY)
    if change == "weights":  # the same architecture, one weight changed
        second = LLM(other_weights(base), **POOL, kv_offload_dir=str(tmp_path))
    elif change == "dtype":  # float16 weights and pool
        second = LLM("tiny-random", dtype="float16", **POOL, kv_offload_dir=str(tmp_path))
    elif change == "cache_salt":  # another tenant
        second, prompt = base.derive(kv_offload_dir=str(tmp_path)), {**prompt, "cache_salt": "tenant-b"}
    else:
        second = base.derive(kv_offload_dir=str(tmp_path), **{"kv_layout": {"kv_layout": "hnd"},
                                                                  "block_size": {"block_size": 8},
                                                                  "kv_cache_dtype": {"kv_cache_dtype": "int8"}}[change])
    with second:
        second.generate(prompt, GREEDY)
        pc = second.stats()["prefix_cache"]
    assert pc["hits"] == 0 and pc["offload"]["blocks_in"] == 0, pc


def test_a_corrupted_or_truncated_file_is_skipped_counted_and_never_loaded(base, tmp_path):
    prompt = {"prompt_token_ids": SYSTEM + question(0, 0)}
    with base.derive(kv_offload_dir=str(tmp_path)) as first:
        want = first.generate(prompt, GREEDY)[0].token_ids
        disk, identity = first.offload_store.disk, first.core._offload_identity
    keys = [store_key(identity, h) for h in block_hashes(prompt["prompt_token_ids"], BS)]
    files = [disk.path(k) for k in keys]  # the chain's blocks in order
    data = bytearray(files[1].read_bytes())
    data[-3] ^= 0x40  # one bit of the second block's payload
    files[1].write_bytes(bytes(data))
    files[2].write_bytes(files[2].read_bytes()[:700])  # truncated
    with base.derive(kv_offload_dir=str(tmp_path)) as second:
        assert second.generate(prompt, GREEDY)[0].token_ids == want
        pc = second.stats()["prefix_cache"]
    # both damaged files were read (a hit's files are read in parallel), counted and deleted; the chain
    # stopped at the first: block 0 alone came from disk, and no byte of a bad file reached the pool
    assert pc["offload"]["tiers"]["disk"]["corrupt_files"] == 2
    assert files[1].read_bytes() != bytes(data)  # the damaged file is gone (rewritten from the recomputed block)
    assert pc["hits_by_tier"]["disk"] == BS and pc["offload"]["load_failures"] == 1
    # the damaged blocks were recomputed and written again: the next engine finds the whole chain
    with base.derive(kv_offload_dir=str(tmp_path)) as third:
        assert third.generate(prompt, GREEDY)[0].token_ids == want
        pc = third.stats()["prefix_cache"]
    assert pc["offload"]["tiers"]["disk"]["corrupt_files"] == 0 and pc["hits_by_tier"]["disk"] == 4 * BS


def test_two_engines_sharing_a_directory_at_once_never_corrupt_it(base, tmp_path):
    a = base.derive(kv_offload_dir=str(tmp_path))
    b = base.derive(kv_offload_dir=str(tmp_path))
    for turn in range(3):  # both write the same shared prefix blocks, interleaved
        for llm in (a, b):
            llm.generate({"prompt_token_ids": SYSTEM + question(turn, 0)}, GREEDY)
    a.close()
    b.close()
    with base.derive(kv_offload_dir=str(tmp_path)) as c:
        chat(c, GREEDY, users=2, turns=1)
        pc = c.stats()["prefix_cache"]
    assert pc["offload"]["tiers"]["disk"]["corrupt_files"] == 0 and pc["hits_by_tier"]["disk"] > 0


def test_budgets_are_never_exceeded(base, tmp_path):
    from minikv.cache.tiers.block_file import file_bytes

    block = base.backend.pool.block_bytes
    disk_budget = 5 * file_bytes(block) + 10
    with base.derive(kv_offload_cpu_bytes=3 * block + 1, kv_offload_dir=str(tmp_path),
                     kv_offload_disk_bytes=disk_budget) as llm:
        chat(llm, GREEDY)
        llm.offload_store.flush()
        tiers = llm.stats()["prefix_cache"]["offload"]["tiers"]
        files = list(llm.offload_store.disk.dir.glob("*.kv"))
    assert tiers["cpu"]["blocks"] == 3 and tiers["cpu"]["bytes"] <= 3 * block + 1
    assert tiers["disk"]["evicted"] > 0 and sum(f.stat().st_size for f in files) <= disk_budget


def test_reset_after_the_weights_change_never_serves_the_old_blocks(tmp_path):
    llm = LLM("tiny-random", **POOL, kv_offload_cpu_bytes=2**20, kv_offload_dir=str(tmp_path))
    prompt = {"prompt_token_ids": SYSTEM + question(0, 0)}
    llm.generate(prompt, GREEDY)
    with torch.no_grad():
        next(llm.model.parameters()).mul_(1.5)
    llm.reset_prefix_cache()
    llm.generate(prompt, GREEDY)
    pc = llm.stats()["prefix_cache"]
    llm.close()
    assert pc["hits"] == 0 and pc["offload"]["blocks_in"] == 0


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    (dict(kv_offload_cpu_bytes=100), "kv_offload_cpu_bytes=100 holds no block"),
    (dict(kv_offload_dir="DIR", kv_offload_disk_bytes=1000), "kv_offload_disk_bytes=1,000 holds no block file"),
    (dict(kv_offload_dir="FILE/sub"), "cannot be written"),
    (dict(kv_offload_disk_bytes=2**20), "give kv_offload_dir"),
    (dict(kv_offload_cpu_bytes=0), "kv_offload_cpu_bytes must be an integer >= 1"),
    (dict(kv_offload_cpu_bytes=2**20, prefix_caching="radix"), "use prefix_caching='hash'"),
    (dict(kv_offload_cpu_bytes=2**20, prefix_caching=None), "use prefix_caching='hash'"),
    (dict(kv_offload_dir=3), "must be a directory path"),
])
def test_bad_offload_options_name_the_limit_and_the_fix(base, tmp_path, options, message):
    (tmp_path / "FILE").write_text("not a directory")
    options = {k: (str(tmp_path / v) if isinstance(v, str) and k == "kv_offload_dir" else v)
               for k, v in options.items()}
    with pytest.raises(ValueError, match=message):
        base.derive(**options)


def test_offload_options_belong_to_the_paged_pool():
    with pytest.raises(ValueError, match="option of the paged pool"):
        LLM("tiny-random", kv_backend="contiguous", kv_offload_cpu_bytes=2**20)


def test_tiers_ttft_benchmark_smoke(capsys, monkeypatch):
    from minikv.bench import tiers_ttft
    from minikv.bench.tiers_ttft import main

    monkeypatch.setattr(tiers_ttft.gc, "collect", lambda: 0)  # a full collection per request: seconds here

    assert main(["--model", "tiny-random", "--doc-len", "40", "--users", "2", "--turns", "2", "--question-len", "8",
                 "--max-tokens", "4", "--block-size", "4", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert '"tokens_identical_to_recompute"' in out and "warm" in out


def test_tier_view_shows_where_each_block_lives_and_the_widget_follows_its_slider(base, tmp_path):
    from minikv.viz.tiers import plot_tiers, run_turn, tier_lines, tiers_widget

    llm = base.derive(num_blocks=12, kv_offload_cpu_bytes=4 * base.backend.pool.block_bytes,
                      kv_offload_dir=str(tmp_path))
    conversations, snaps = {}, []
    for i, user in enumerate(["a", "b", "a", "c"]):
        prompt = conversations.get(user, SYSTEM) + question(i, 1)
        snaps.append(run_turn(llm, conversations, user, prompt, GREEDY)[0])
    last = snaps[-1]
    rows = {name: "".join("P" if p else "C" if c else "D" if d else "." for p, c, d in row)
            for name, row in last.rows.items()}
    assert all(line.strip().startswith(f"{n} [{r}]") for n, r in rows.items()
               for line in tier_lines(last) if line.strip().startswith(f"{n} ["))
    # down a tier
    assert "C" in "".join(rows.values()) and 0 < last.occupancy["cpu"][0] <= last.occupancy["cpu"][1] == 4
    assert all(d for row in last.rows.values() for (_, _, d) in row[:-1])  # written through: all on disk
    assert snaps[2].hits and snaps[2].computed < len(conversations["a"])  # a came back: hits from some tier
    plot_tiers(last)
    view = tiers_widget(snaps, step=len(snaps) - 1)
    slider, image = view.children[0], view.children[1]
    first = bytes(image.value)
    slider.value = 0
    assert bytes(image.value) != first
    llm.close()
