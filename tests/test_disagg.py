"""Prefill and decode on separate engines (rung 13): the prompt's KV blocks are sent over a
torch.distributed (gloo) pair of ranks, and the decode engine admits the request with them as if it
had computed them. Both ranks live in this process (one thread each): the point-to-point transport is
the one two processes use, without the cost of starting them."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.serve.disagg import Inbox, KVChannel, receive_prefill, send_prefill

from test_serve import wait_until  # noqa: E402  (tests/ is on the path)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIONS = dict(kv_backend="paged", block_size=16, num_blocks=64, max_model_len=512, prefix_caching="hash",
               dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prefill():
    return LLM("tiny-random", **OPTIONS)


def ids_of(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j) % 400 + 3 for j in range(n)]


def transfer(prefill: LLM, decode: LLM, ids: list[int], salt: str | None = None,
             channels: tuple[KVChannel, KVChannel] | None = None) -> tuple[int, int]:
    """(blocks the prefill engine sent, blocks the decode engine took), the two sides on two threads."""
    a, b = channels or KVChannel.pair()
    sent: list[int] = []
    t = threading.Thread(target=lambda: sent.append(send_prefill(prefill, a, ids, salt)))
    t.start()
    got = receive_prefill(decode, b, ids, salt)
    t.join()
    return sent[0], got


def test_a_transferred_block_is_bit_identical_to_the_one_the_decode_engine_computes(prefill):
    ids = ids_of(1, 70)  # 4 full blocks and a tail
    decode = prefill.derive(kv_offload_store=Inbox())
    assert transfer(prefill, decode, ids) == (4, 4)
    alone = prefill.derive()  # one engine, computing everything itself
    params = SamplingParams(max_tokens=12, temperature=0)
    assert decode.generate(ids, params)[0].token_ids == alone.generate(ids, params)[0].token_ids
    stats = decode.stats()
    assert stats["requests"][0]["num_cached_tokens"] == 64  # admitted on the 4 received blocks
    assert stats["prefix_cache"]["offload"]["blocks_in"] == 4
    keys_d, planes_d = decode.core.export_prefix(ids)
    keys_a, planes_a = alone.core.export_prefix(ids)
    assert keys_d == keys_a and len(planes_d) == 2
    assert all(torch.equal(x, y) for x, y in zip(planes_d, planes_a))  # K and V, bit for bit
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=3)
    assert decode.generate(ids, seeded)[0].token_ids == alone.generate(ids, seeded)[0].token_ids


def test_only_the_blocks_the_decode_engine_lacks_are_sent(prefill):
    decode = prefill.derive(kv_offload_store=Inbox())
    first, longer = ids_of(2, 40), ids_of(2, 40) + ids_of(3, 40)
    assert transfer(prefill, decode, first) == (2, 2)
    decode.generate(first, SamplingParams(max_tokens=1))
    assert transfer(prefill, decode, longer) == (3, 3)  # blocks 2..4: the first two are there already
    assert transfer(prefill, decode, longer) == (0, 0)


def test_blocks_never_cross_into_another_models_or_another_tenants_cache(prefill):
    other = LLM("tiny-random", **{**OPTIONS, "block_size": 32, "kv_offload_store": Inbox()})
    ids = ids_of(4, 48)
    assert transfer(prefill, other, ids) == (0, 0)  # another identity (here the pool's format): refused
    decode = prefill.derive(kv_offload_store=Inbox())
    assert transfer(prefill, decode, ids, salt="tenant-a") == (3, 3)
    decode.generate([{"prompt_token_ids": ids, "cache_salt": "tenant-b"}], SamplingParams(max_tokens=1))
    assert decode.stats()["requests"][0]["num_cached_tokens"] == 0  # tenant b never reads tenant a's blocks


def test_the_identity_is_kept_between_transfers_and_taken_again_after_a_reset(monkeypatch):
    """kv_identity is asked on every transfer: it is taken once (stamping the weights reads every tensor,
    and on a GPU each read waits for the engine's queued work), and again after reset_prefix_cache, which
    changed weights need: then a peer with the old weights refuses the blocks."""
    import minikv.engine.core as core_module

    engine = LLM("tiny-random", **OPTIONS)
    peer = LLM("tiny-random", **OPTIONS, kv_offload_store=Inbox())  # its own copy of the same weights
    calls = []
    real = core_module.weights_fingerprint
    monkeypatch.setattr(core_module, "weights_fingerprint", lambda model, *a: calls.append(model) or real(model, *a))
    mine = engine.core.model
    first = engine.core.kv_identity()
    assert [engine.core.kv_identity() for _ in range(5)] == [first] * 5 and calls.count(mine) == 1
    assert transfer(engine, peer, ids_of(8, 40)) == (2, 2)  # the same weights: taken
    with torch.no_grad():
        next(engine.core.model.parameters()).add_(1.0)  # the weights change in place...
    engine.reset_prefix_cache()  # ...and the cache is reset, as reset_prefix_cache's docstring asks
    assert engine.core.kv_identity() != first and calls.count(mine) == 2
    assert transfer(engine, peer, ids_of(9, 40)) == (0, 0)  # the peer still has the old weights: refused


def test_one_transfer_carries_many_requests_and_a_block_they_share_crosses_once(prefill):
    from minikv.serve.disagg import _receive_blocks, _send_blocks

    shared = ids_of(8, 32)
    prompts = {7: shared + ids_of(9, 20), 9: shared + ids_of(10, 36), 11: ids_of(11, 10)}  # transfer id: prompt
    prefill.generate(list(prompts.values()), SamplingParams(max_tokens=1))
    requests = [(tid, *prefill.core.export_prefix(ids)) for tid, ids in prompts.items()]
    decode = prefill.derive(kv_offload_store=Inbox())
    a, b = KVChannel.pair()
    sent: list[list[int]] = []
    t = threading.Thread(target=lambda: sent.append(_send_blocks(a, prefill.core.kv_identity(), requests)))
    t.start()
    got = _receive_blocks(decode, b, lambda tid: (prompts[tid], None))
    t.join()
    assert got == [(7, 3), (9, 2), (11, 0)] and sent == [[3, 2, 0]]  # 9's first two blocks come with 7's
    params, tokens, cached = SamplingParams(max_tokens=6, temperature=0, seed=1), [], []
    for ids in prompts.values():
        tokens.append(decode.generate(ids, params)[0].token_ids)
        cached.append(decode.stats()["requests"][0]["num_cached_tokens"])
    assert tokens == one_engine(prefill.derive(), list(prompts.values())) and cached == [48, 64, 0]


def test_a_transfer_that_times_out_falls_back_to_computing_the_prompt(prefill):
    decode = prefill.derive(kv_offload_store=Inbox())
    a, b = KVChannel.pair(timeout_s=0.5)  # nobody sends on `a`: the decode side's wait ends
    ids = ids_of(5, 40)
    assert receive_prefill(decode, b, ids) == 0 and b.broken
    params = SamplingParams(max_tokens=6, temperature=0)
    assert decode.generate(ids, params)[0].token_ids == prefill.derive().generate(ids, params)[0].token_ids
    with pytest.raises(ValueError, match="kv_offload_store=Inbox"):
        receive_prefill(prefill, b, ids)


def test_through_the_router_a_decode_server_takes_the_prompts_blocks_from_its_prefill_server(prefill):
    import httpx

    from minikv.serve import Server
    from minikv.serve.app_thread import AppThread
    from minikv.serve.disagg import DecodeSide, build_prefill_app
    from minikv.serve.router import Router

    a, b = KVChannel.pair()
    decode = prefill.derive(kv_offload_store=Inbox())
    side = DecodeSide(decode, b)
    ids = ids_of(6, 60)
    want = prefill.derive().generate(ids, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    with AppThread(build_prefill_app(prefill, a)) as p, Server(decode, served_name="m", before_submit=side) as d, \
            Router([d.url], prefill=[p.url]) as r:
        body = {"model": "m", "prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        out = httpx.post(r.url + "/v1/completions", json=body, timeout=120, trust_env=False).json()
        assert out["choices"][0]["token_ids"] == want
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # the 3 blocks sent, not computed
        assert (side.transfers, side.received_blocks, p.app.state.sent_blocks) == (1, 3, 3)
        direct = httpx.post(d.url + "/v1/completions", json={**body, "prompt": ids_of(7, 40)}, timeout=120,
                            trust_env=False).json()  # no prefill server named: computed on the decode engine
        assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and side.transfers == 1
    with pytest.raises(ValueError, match="one --prefill URL per --decode URL"):
        Router(["http://d1", "http://d2"], prefill=["http://p1"])




def hold_first_round(batcher, total: int) -> None:
    """The prefill engine's first round runs one prompt alone while the rest of the burst waits behind
    it, whatever this machine's speed: it waits until all `total` prompts have arrived (in that round or
    queued behind it), keeps the first and puts the others back at the head of the queue, in order, for
    the next round, which starts once the first prompt's transfer is done. A fast server may hand the
    first round several prompts at once: the batch list is cut in place, so the batcher sees only the
    one it ran."""
    run, held = batcher._run, []

    def first_waits(batch):
        if held:
            return run(batch)
        held.append(True)
        wait_until(lambda: len(batch) + len(batcher.waiting) >= total, "the whole burst arrived", timeout_s=60)
        with batcher.cond:
            batcher.waiting.extendleft(reversed(batch[1:]))
            del batch[1:]
        run(batch)
        wait_until(lambda: batcher.transfers >= 1, "the first prompt's transfer", timeout_s=60)  # alone
    batcher._run = first_waits


def burst(prefill: LLM, decode: LLM, prompts: list[list[int]], prefill_end: KVChannel, decode_end: KVChannel,
          max_tokens: int = 6):
    """Send every prompt at once through a router in front of a prefill/decode pair: (outputs in order,
    the prefill server's /health, the decode side)."""
    import httpx

    from minikv.serve import Server
    from minikv.serve.app_thread import AppThread
    from minikv.serve.disagg import DecodeSide, build_prefill_app
    from minikv.serve.router import Router

    side = DecodeSide(decode, decode_end)
    app = build_prefill_app(prefill, prefill_end)
    hold_first_round(app.state.batcher, len(prompts))
    with AppThread(app) as p, Server(decode, served_name="m", before_submit=side) as d, \
            Router([d.url], prefill=[p.url]) as r, ThreadPoolExecutor(len(prompts)) as pool:
        def ask(ids):
            body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "seed": 1,
                    "return_token_ids": True}
            return httpx.post(r.url + "/v1/completions", json=body, timeout=120, trust_env=False).json()
        outs = list(pool.map(ask, prompts))
        health = httpx.get(p.url + "/health", timeout=30, trust_env=False).json()
    return outs, health, side


def one_engine(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, seed=1)
    return [llm.generate(ids, params)[0].token_ids for ids in prompts]


def test_a_burst_is_prefilled_in_fewer_engine_calls_than_requests_and_answers_as_one_engine(prefill):
    shared = ids_of(19, 32)  # two blocks every prompt starts with
    prompts = [shared + ids_of(20 + i, 8 + 9 * i) for i in range(8)]
    outs, health, side = burst(prefill, prefill.derive(kv_offload_store=Inbox()), prompts, *KVChannel.pair())
    assert [o["choices"][0]["token_ids"] for o in outs] == one_engine(prefill.derive(), prompts)
    full = [len(ids) // 16 * 16 for ids in prompts]
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs] == full  # no block computed twice
    assert (health["prefilled"], health["rounds"]) == (8, 2)  # the first prompt alone, then the 7 behind it
    unique = 2 + sum(n // 16 - 2 for n in full)  # the shared blocks crossed once, whatever the transfers held
    assert side.transfers == 8 and side.received_blocks == health["sent_blocks"] == unique


class LinkDownAt(KVChannel):
    """A prefill end whose link goes down when it sends the blocks of its `at`-th transfer."""

    def __init__(self, end: KVChannel, at: int):
        super().__init__(end.group, end.rank, end.device)
        self.at, self.planes = at, 0

    def send(self, t: torch.Tensor) -> None:
        if t.dtype == torch.uint8:  # a transfer's planes (its head and index are posted, not sent)
            self.planes += 1
            if self.planes == self.at:
                raise ConnectionError("link down")
        super().send(t)


def test_a_transfer_failure_mid_burst_falls_back_for_the_requests_it_affects_only(prefill):
    prompts = [ids_of(40 + i, 48) for i in range(6)]
    a, b = KVChannel.pair()
    outs, health, side = burst(prefill, prefill.derive(kv_offload_store=Inbox()), prompts, LinkDownAt(a, 2), b)
    assert [o["choices"][0]["token_ids"] for o in outs] == one_engine(prefill.derive(), prompts)
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    landed = cached.count(32)  # the first transfer's requests (3 blocks each; the last token runs)
    assert 1 <= landed < 6 and landed + cached.count(0) == 6  # the rest were computed on the decode engine
    assert health["status"] == "KV channel failed" and health["failed"] == 6 - landed
    assert side.received_blocks == 3 * landed


def test_a_prompt_the_prefill_engine_refuses_is_computed_on_the_decode_engine_alone(prefill):
    prompts = [ids_of(60 + i, 40) for i in range(4)] + [ids_of(64, 530)]  # 530 > the prefill engine's 512
    decode = prefill.derive(kv_offload_store=Inbox(), max_model_len=1024)
    outs, health, side = burst(prefill, decode, prompts, *KVChannel.pair())
    assert [o["choices"][0]["token_ids"] for o in outs] == one_engine(prefill.derive(max_model_len=1024), prompts)
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    assert cached == [32, 32, 32, 32, 0]  # its neighbours in the same round were sent
    assert health["status"] == "ok" and health["failed"] == 1 and side.received_blocks == 8


@pytest.mark.slow  # SmolLM2's load
def test_smollm2_through_the_router_and_a_prefill_decode_pair_answers_as_one_engine(smollm2_dir):
    import httpx

    from minikv.serve import Server
    from minikv.serve.app_thread import AppThread
    from minikv.serve.disagg import DecodeSide, build_prefill_app
    from minikv.serve.router import Router

    one = LLM(str(smollm2_dir), kv_backend="paged", block_size=16, num_blocks=128, max_model_len=512,
              prefix_caching="hash", dtype="float32", device="cpu")
    prompt = one.chat_prompt("Why is the sky blue? Answer in one sentence.")
    want = one.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0].text
    a, b = KVChannel.pair()
    decode = one.derive(kv_offload_store=Inbox())
    side = DecodeSide(decode, b)
    with AppThread(build_prefill_app(one.derive(), a)) as p, Server(decode, served_name="m", before_submit=side) as d, \
            Router([d.url], prefill=[p.url]) as r:
        out = httpx.post(r.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 10,
                                                           "temperature": 0}, timeout=300, trust_env=False).json()
    assert out["choices"][0]["text"] == want
    assert side.received_blocks >= 1 and out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
