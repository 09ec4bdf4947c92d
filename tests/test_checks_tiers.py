"""Exercise 10a's checker (a two-tier LRU block store) passes the reference answer, catches the
mistakes learners make and names them, and the engine serves a chat with the learner's store under
its pool through the kv_offload_store seam (tiny-random here and in the notebook)."""
from __future__ import annotations

from collections import OrderedDict

import pytest

from minikv import LLM
from minikv.checks.report import CheckFailed
from minikv.checks.tiers import check_store_in_engine, check_two_tier_store


class TwoTierStore:
    def __init__(self, fast_blocks, slow_blocks):
        self.fast_blocks, self.slow_blocks = fast_blocks, slow_blocks
        self.fast, self.slow = OrderedDict(), OrderedDict()

    def put(self, key, value):
        self.slow.pop(key, None)
        self.fast[key] = value
        self.fast.move_to_end(key)
        if len(self.fast) > self.fast_blocks:
            old, old_value = self.fast.popitem(last=False)
            self.slow[old] = old_value
            if len(self.slow) > self.slow_blocks:
                self.slow.popitem(last=False)

    def get(self, key):
        for tier in (self.fast, self.slow):
            if key in tier:
                tier.move_to_end(key)
                return tier[key]
        return None

    def __contains__(self, key):
        return key in self.fast or key in self.slow

    def where(self, key):
        return "fast" if key in self.fast else "slow" if key in self.slow else None


class DropsInsteadOfMovingDown(TwoTierStore):
    def put(self, key, value):
        self.slow.pop(key, None)
        self.fast[key] = value
        self.fast.move_to_end(key)
        if len(self.fast) > self.fast_blocks:
            self.fast.popitem(last=False)


class EvictsMostRecent(TwoTierStore):
    def put(self, key, value):
        self.slow.pop(key, None)
        if key not in self.fast and len(self.fast) == self.fast_blocks:
            old, old_value = self.fast.popitem(last=True)
            self.slow[old] = old_value
            if len(self.slow) > self.slow_blocks:
                self.slow.popitem(last=False)
        self.fast[key] = value


class GetDoesNotRefresh(TwoTierStore):
    def get(self, key):
        return self.fast.get(key, self.slow.get(key))


class KeepsStaleCopyBelow(TwoTierStore):
    def put(self, key, value):  # forgets to take the key out of the slow tier
        self.fast[key] = value
        self.fast.move_to_end(key)
        if len(self.fast) > self.fast_blocks:
            old, old_value = self.fast.popitem(last=False)
            self.slow[old] = old_value
            if len(self.slow) > self.slow_blocks:
                self.slow.popitem(last=False)


class Stub:
    def __init__(self, fast_blocks, slow_blocks):
        raise NotImplementedError("set up the two tiers")


def test_task_10a_reference_store_passes_every_case(capsys):
    check_two_tier_store(TwoTierStore)
    assert "cases passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (DropsInsteadOfMovingDown, "goes down to the slow tier, never straight out"),
    (EvictsMostRecent, "in tier"),
    (GetDoesNotRefresh, "makes a key the most recent of its own tier"),
    (KeepsStaleCopyBelow, "in tier"),
])
def test_task_10a_checker_names_the_usual_mistakes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check_two_tier_store(wrong)


def test_task_10a_unfinished_stub_reads_as_its_own_error():
    with pytest.raises(NotImplementedError, match="set up the two tiers"):
        check_two_tier_store(Stub)


def engine(store):
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=16, prefix_caching="hash",
               kv_offload_store=store)


def test_task_10a_the_engine_serves_a_chat_from_the_learners_store(capsys):
    pc = check_store_in_engine(engine(TwoTierStore(6, 12)), TwoTierStore, 6, 12)
    assert pc["hits_by_tier"].get("fast", 0) > 0 and pc["hits_by_tier"].get("slow", 0) > 0
    assert "tokens equal recomputing" in capsys.readouterr().out


class SwapsValues(TwoTierStore):
    def get(self, key):
        value = super().get(key)
        others = [v for k, v in list(self.fast.items()) + list(self.slow.items()) if k != key]
        return others[0] if value is not None and others else value


def test_task_10a_a_store_returning_another_keys_block_changes_the_tokens_and_fails():
    with pytest.raises(CheckFailed, match="differ from recomputing"):
        check_store_in_engine(engine(SwapsValues(6, 12)), SwapsValues, 6, 12)


def test_the_store_seam_needs_the_hash_chain_and_a_store():
    with pytest.raises(ValueError, match="rung 9"):
        LLM("tiny-random", kv_backend="paged", prefix_caching="radix", kv_offload_store=TwoTierStore(1, 1))
    with pytest.raises(ValueError, match="not both"):
        LLM("tiny-random", kv_backend="paged", prefix_caching="hash", kv_offload_store=TwoTierStore(1, 1),
            kv_offload_cpu_bytes=2**20)
