"""The in-engine checks of exercises 06a (hash chain) and 06b (radix match) run the function they are
given, built into `llm.derive(prefix_caching=...)` when the check runs: a learner who fixes a function and
re-runs only the check cell gets the fix checked, whatever the LLM was built with. SmolLM2, since the
checks speak in chat prompts (tiny-random has no tokenizer)."""
from __future__ import annotations

import os

import pytest

from minikv import LLM
from minikv.cache.prefix.hash_chain import HashChainCache, block_hashes, hash_block
from minikv.cache.prefix.radix import RadixCache, match_prefix
from minikv.checks.prefix import check_hash_chain_in_engine, check_radix_in_engine
from minikv.checks.report import CheckFailed

SYSTEM = "You are a patient tutor. Answer in one short sentence."
QUESTIONS = ["What is a KV cache?", "Why do two requests share a prefix?"]


def saltless(parent, token_ids, extra=()):  # the tenant's salt never enters the key
    return hash_block(parent, token_ids, ())


def unstable(parent, token_ids, extra=()):  # a new key at every call: nothing ever hits
    return os.urandom(32)


def no_match(root, token_ids, block_size):  # the walk never finds anything
    return [], 0


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m", kv_backend="paged", block_size=16, num_blocks=128, max_model_len=512)


@pytest.mark.slow
def test_task_06a_the_check_hashes_with_the_function_it_is_given(smollm2, capsys):
    stale = smollm2.derive(prefix_caching=HashChainCache(16, hash_fn=saltless))  # built around a broken hash
    check_hash_chain_in_engine(stale, hash_block, block_hashes, SYSTEM, QUESTIONS)
    assert "tenants hit their own prompts only" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="only 0 of block_hashes' keys for its prompt are in the engine's table"):
        check_hash_chain_in_engine(smollm2, unstable, block_hashes, SYSTEM, QUESTIONS)


@pytest.mark.slow
def test_task_06b_the_check_walks_with_the_function_it_is_given(smollm2, capsys):
    stale = smollm2.derive(prefix_caching=RadixCache(16, match_fn=no_match))
    check_radix_in_engine(stale, match_prefix, SYSTEM, ["Name a planet.", "How far is it from the Sun?"], 6)
    assert "every turn hits on the turns before it" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="tokens came from the cache, expected at least"):
        check_radix_in_engine(smollm2, no_match, SYSTEM, ["Name a planet.", "How far is it from the Sun?"], 6)
