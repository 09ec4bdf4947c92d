"""Checkers for the prefix-caching exercises (06a: the block hash chain, 06b: radix longest-prefix match).

    hash_block(parent, token_ids, extra_keys) -> key      one full block's key (bytes, stable)
    block_hashes(token_ids, block_size, cache_salt)       the keys of every full block, chained
    match_prefix(root, token_ids, block_size)             -> (blocks, num_tokens), whole blocks only

Each checker runs hand-picked cases first (each teaches one rule and its failure names that rule),
then random ones against the engine's own functions, then plugs the learner's function into a
running engine (built by the check each time it runs, from the weights of the LLM it is given, so a
fixed function is the one checked): the tokens must equal caching off, and the cache must hit where
it should.
"""
from __future__ import annotations

import random

from minikv.cache.prefix.hash_chain import extra_keys
from minikv.cache.prefix.radix import Node, RadixCache
from minikv.cache.prefix.radix import match_prefix as reference_match_prefix
from minikv.checks.report import fail, passed


def _short(key) -> str:
    return key.hex()[:12] + "…" if isinstance(key, bytes) else repr(key)[:40]


# ---- exercise 06a: hash_block --------------------------------------------------------------------
def check_hash_block(hash_block) -> None:
    """The rules a block key must follow, one case each."""
    toks = (5, 17, 230, 4)
    k = hash_block(None, toks, ())
    if k is None:
        fail("hash_block(None, (5, 17, 230, 4), ())", "it returned None", "the function must return the key",
             "did it forget to `return`?")
    if isinstance(k, int):
        fail("hash_block(None, (5, 17, 230, 4), ())", f"it returned an int ({k})",
             "Python's hash() of a str or bytes is salted per process: another process (or a restart) computes "
             "other keys, so a cache shared between processes, or saved to disk, never hits",
             "hash a byte string with hashlib.sha256(...).digest()")
    if not isinstance(k, (bytes, str)):
        fail("hash_block(None, (5, 17, 230, 4), ())", f"it returned a {type(k).__name__}",
             "expected bytes (a hashlib digest) or its hex string")
    cases = [
        ("the same block hashed twice", lambda: hash_block(None, toks, ()) == k, True,
         "a key must be a pure function of its inputs (no randomness, no counter, no id())"),
        ("the tokens as a list or a tuple", lambda: hash_block(None, list(toks), ()) == k, True,
         "convert the tokens to one canonical form (a tuple of ints) before hashing"),
        ("a different parent key", lambda: hash_block(k, toks, ()) != k, True,
         "the parent key must go into the hash: it is what makes a block's key stand for its whole prefix"),
        ("one token changed", lambda: hash_block(None, (5, 17, 231, 4), ()) != k, True,
         "every token of the block must go into the hash"),
        ("two tokens swapped", lambda: hash_block(None, (17, 5, 230, 4), ()) != k, True,
         "order matters: hash the tokens in order (no sum, no set)"),
        ("(1, 23, 4, 5) against (12, 3, 4, 5)", lambda: hash_block(None, (1, 23, 4, 5), ()) !=
         hash_block(None, (12, 3, 4, 5), ()), True,
         "the serialisation is ambiguous: '1'+'23' == '12'+'3'. Put separators between tokens "
         "(repr of a tuple does), or pack each id in a fixed number of bytes"),
        ("a cache_salt in the extra keys", lambda: hash_block(None, toks, (("cache_salt", "alice"),)) != k, True,
         "the extra keys (the tenant's cache_salt) must go into the hash, or two tenants share blocks"),
        ("two different salts", lambda: hash_block(None, toks, (("cache_salt", "alice"),)) !=
         hash_block(None, toks, (("cache_salt", "bob"),)), True, "the salt's value must go into the hash"),
    ]
    for what, test, want, hint in cases:
        try:
            got = test()
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(f"case: {what}", "hash_block raised", f"{type(e).__name__}: {e}")
        if got != want:
            fail(f"case: {what}", "the keys " + ("differ" if want else "are equal"),
                 "they should " + ("be equal" if want else "differ"), hint)
    passed(len(cases) + 1, "hash_block is stable, canonical, and depends on the parent, every token in order, "
                           "and the extra keys")


# ---- exercise 06a: block_hashes ------------------------------------------------------------------
def expected_block_hashes(hash_block, token_ids, block_size, cache_salt=None) -> list:
    keys = []
    for i in range(len(token_ids) // block_size):
        keys.append(hash_block(keys[-1] if keys else None, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                               extra_keys(i, cache_salt)))
    return keys


def _diagnose(hash_block, token_ids, bs, salt, i, got_key, want) -> str:
    toks = tuple(token_ids[i * bs:(i + 1) * bs])
    parent = want[i - 1] if i else None
    guesses = [
        (hash_block(None, toks, extra_keys(i, salt)), "it is hash_block(None, ...): the parent key is missing, so "
         "the key stands for this block's tokens alone and two prompts that differ earlier would share it"),
        (hash_block(parent, toks, ()), "it has no extra keys: the cache_salt must enter the FIRST block "
         "(extra_keys(0, cache_salt))"),
        (hash_block(parent, toks, extra_keys(0, salt)), "the salt went into every block: it belongs to the first "
         "block only (use extra_keys(i, cache_salt)); later blocks inherit it through the parent key"),
    ]
    if i + 1 < len(want):
        guesses.append((hash_block(parent, tuple(token_ids[(i + 1) * bs:(i + 2) * bs]), extra_keys(i, salt)),
                        "it hashed the tokens of the NEXT block: block i holds token_ids[i*bs:(i+1)*bs]"))
    for key, why in guesses:
        if got_key == key and key != want[i]:
            return why
    return ("block i's key is hash_block(key of block i-1 (None for block 0), tuple(token_ids[i*bs:(i+1)*bs]), "
            "extra_keys(i, cache_salt))")


def check_block_hashes(block_hashes, hash_block, num_random: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    cases = [
        (list(range(8)), 4, None, "two full blocks, no salt"),
        (list(range(10)), 4, None, "a partial last block (2 tokens): it gets no key, only full blocks are cached"),
        (list(range(3)), 4, None, "shorter than one block: no key at all"),
        (list(range(12)), 4, "alice", "a salted request: the salt enters block 0 and flows down the chain"),
        ([], 4, None, "no tokens"),
    ]
    cases += [([rng.randrange(50) for _ in range(rng.randint(0, 40))], rng.choice([2, 4, 8]),
               rng.choice([None, "alice", "bob"]), "random") for _ in range(num_random)]
    for toks, bs, salt, lesson in cases:
        case = f"case: {lesson}\n  token_ids={toks if len(toks) < 20 else str(toks[:20])[:-1] + ', ...]'}, " \
               f"block_size={bs}, cache_salt={salt!r}"
        want = expected_block_hashes(hash_block, toks, bs, salt)
        try:
            got = block_hashes(toks, bs, salt)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, "block_hashes raised", f"{type(e).__name__}: {e}")
        if got is None:
            fail(case, "it returned None", "expected a list of keys", "did it forget to `return`?")
        got = list(got)
        if len(got) != len(want):
            why = (f"{len(toks)} tokens hold {len(toks) // bs} full blocks of {bs}"
                   + (f"; the last {len(toks) % bs} tokens are a partial block, never hashed" if len(got) > len(want)
                      and len(toks) % bs else ""))
            fail(case, f"it returned {len(got)} keys, expected {len(want)}", why)
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                fail(case, f"first wrong key at block {i}: expected {_short(w)}, got {_short(g)}",
                     _diagnose(hash_block, toks, bs, salt, i, g, want))
    passed(len(cases), "block_hashes chains every full block from its parent, with the salt in the first")


def check_hash_chain_in_engine(llm, hash_block, block_hashes, system: str, questions: list[str]) -> None:
    """The engine hashes with your hash_block: `llm.derive(prefix_caching=HashChainCache(block_size,
    hash_fn=hash_block))`, built here from `llm`'s weights each time the check runs (so a fixed
    function is checked without rebuilding anything). Two tenants ask questions after a shared system
    prompt: every answer must equal caching off, a tenant must hit on its own earlier prompts and never
    on the other's, and the keys the engine stored must be block_hashes' keys."""
    from minikv import SamplingParams
    from minikv.cache.prefix.hash_chain import HashChainCache

    if llm.block_size is None:
        raise ValueError("build the LLM with kv_backend='paged': the prefix cache keeps whole blocks")
    llm = llm.derive(prefix_caching=HashChainCache(llm.block_size, hash_fn=hash_block))
    cache, bs = llm.prefix_cache, llm.block_size
    sp = SamplingParams(max_tokens=8)
    prompts = [llm.chat_prompt(q, system=system) for q in questions]
    llm.reset_prefix_cache()
    off = []
    for p in prompts:  # caching off: an empty cache before every request
        off.append(llm.generate({"prompt": p, "cache_salt": "alice"}, sp)[0].token_ids)
        llm.reset_prefix_cache()
    runs = [("alice", p) for p in prompts] + [("bob", prompts[0])]
    for n, (tenant, p) in enumerate(runs):
        out = llm.generate({"prompt": p, "cache_salt": tenant}, sp)[0]
        i = prompts.index(p)
        if out.token_ids != off[i]:
            fail(f"request {n} ({tenant}: {questions[i]!r})", "its tokens differ from caching off",
                 f"expected {off[i]}, got {out.token_ids}", "a block was served for a prefix it does not hold")
        ids = llm.encode(p)[0]
        if n == 0 or tenant == "bob":
            if out.num_cached_tokens:
                fail(f"request {n} ({tenant})", f"{out.num_cached_tokens} tokens came from the cache",
                     "nothing of this tenant was cached yet: it must not hit another tenant's blocks",
                     "the cache_salt must change the key of the first block (and so of every later one)")
        elif out.num_cached_tokens < bs:
            fail(f"request {n} ({tenant})", f"only {out.num_cached_tokens} tokens came from the cache",
                 "the shared system prompt should hit", "are the keys stable from one call to the next?")
        keys = block_hashes(ids, bs, tenant)
        stored = sum(1 for k in keys[:(len(ids) - 1) // bs] if k in cache.table)
        if stored < (len(ids) - 1) // bs:
            fail(f"request {n} ({tenant})", f"only {stored} of block_hashes' keys for its prompt are in the "
                 "engine's table", "the engine chains your hash_block exactly like block_hashes should")
    passed(len(runs), "the engine, hashing with your hash_block, gives the tokens of caching off; tenants hit "
                      "their own prompts only; block_hashes gives the engine's keys")


# ---- exercise 06b: radix longest-prefix match ---------------------------------------------------
class _Seq:
    """The little a RadixCache needs to insert a token list."""

    _ids = iter(range(10**9))

    def __init__(self, tokens: list[int], blocks: list[int], salt=None):
        self.seq_id, self.request_id = next(self._ids), "case"
        self.token_ids, self.block_table, self.cache_salt = tokens, blocks, salt
        self.num_computed_tokens = len(tokens)


def build_tree(sequences: list[list[int]], block_size: int) -> RadixCache:
    """A radix tree holding `sequences` (whole blocks), block ids handed out in order."""
    cache = RadixCache(block_size)
    cache.bind([1] * 100_000)
    next_block = 0
    for toks in sequences:
        hit = cache.match(toks)
        blocks = hit.blocks + list(range(next_block, next_block + len(toks) // block_size - len(hit.blocks)))
        next_block += len(blocks) - len(hit.blocks)
        cache.insert(_Seq(toks, blocks))
    return cache


def _root(cache: RadixCache) -> Node:
    return cache.roots.get(None) or Node()


def check_radix_match(match_prefix, num_random: int = 300, seed: int = 1) -> None:
    sys_p, a, b = [1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22, 23], [30, 31, 32, 33]
    bs = 4
    tree = build_tree([sys_p + a + [40, 41, 42, 43], sys_p + b], bs)  # root -> [sys] -> {[a 40..], [b]}
    cases = [
        (tree, sys_p + a + [40, 41, 42, 43], "the whole first request: two edges, followed to the end"),
        (tree, sys_p + b + [99], "the second request plus one more token: its partial block is never matched"),
        (tree, sys_p + [20, 21, 22, 99], "diverges inside block 2: that block does not match at all"),
        (tree, sys_p + a + [40, 41, 99, 99], "diverges inside the second edge: the edge matches part-way, "
                                             "block by block"),
        (tree, [1, 2, 3, 4, 5, 6], "shorter than the edge: only the first block is whole"),
        (tree, [9, 9, 9, 9, 1, 2, 3, 4], "no child starts with the first block: nothing matches"),
        (tree, [1, 2], "fewer tokens than a block"),
        (build_tree([], bs), sys_p, "an empty tree"),
    ]
    rng = random.Random(seed)
    for _ in range(num_random):
        bs_r = rng.choice([2, 4])
        stems = [[rng.randrange(4) for _ in range(rng.randint(0, 12))] for _ in range(3)]
        seqs = [rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(0, 10))] for _ in range(4)]
        t = build_tree([s[: len(s) // bs_r * bs_r] for s in seqs], bs_r)
        cases.append((t, rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(0, 10))], "random"))
    for cache, toks, lesson in cases:
        bsz = cache.block_size
        want = reference_match_prefix(_root(cache), toks, bsz)
        case = f"case: {lesson}\n  token_ids={toks}, block_size={bsz}"
        try:
            got = match_prefix(_root(cache), toks, bsz)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001  shown to the learner
            fail(case, "match_prefix raised", f"{type(e).__name__}: {e}")
        if got is None:
            fail(case, "it returned None", "expected (blocks, num_tokens)", "did it forget to `return`?")
        blocks, n = list(got[0]), got[1]
        if (blocks, n) == (list(want[0]), want[1]):
            continue
        hint = None
        if n % bsz:
            hint = f"{n} is not a multiple of block_size {bsz}: a block is reused whole or not at all"
        elif n != len(blocks) * bsz:
            hint = "num_tokens must be len(blocks) * block_size"
        elif n > want[1]:
            hint = ("it matched blocks whose tokens differ: compare each block of the edge with the tokens, "
                    "and stop at the first block that differs")
        elif blocks == want[0][:len(blocks)] and blocks:
            hint = ("it stopped early: after an edge matches to its end, go on into the child whose key starts "
                    "with the next block of tokens")
        fail(case, f"expected ({list(want[0])}, {want[1]}), got ({blocks}, {n})",
             "the tree:\n    " + "\n    ".join(_tree_text(cache)), hint)
    passed(len(cases), "match_prefix walks the tree block by block and stops at the first block that differs")


def _tree_text(cache: RadixCache) -> list[str]:
    lines = []
    for node, depth in cache.nodes():
        if node.parent is not None:
            lines.append("  " * (depth - 1) + f"[{' '.join(map(str, node.key))}] blocks {node.blocks}")
    return lines or ["(empty)"]


def check_radix_in_engine(llm, match_prefix, system: str, turns: list[str], max_tokens: int = 12) -> None:
    """Every lookup is your walk: `llm.derive(prefix_caching=RadixCache(block_size, match_fn=match_prefix))`,
    built here from `llm`'s weights each time the check runs. A chat of several turns: every answer
    must equal caching off, and each turn must hit on everything before its new message (the earlier
    questions AND answers: generated tokens are in the tree too)."""
    from minikv import SamplingParams

    if llm.block_size is None:
        raise ValueError("build the LLM with kv_backend='paged': the radix tree keeps whole blocks")
    llm = llm.derive(prefix_caching=RadixCache(llm.block_size, match_fn=match_prefix))

    sp = SamplingParams(max_tokens=max_tokens)
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    history: list[int] = []
    for n, message in enumerate(turns):
        if not history:
            ids = encode(llm.chat_prompt(message, system=system))
        else:  # the chat template's next turn, appended token by token to what the engine has seen
            closed = history[-1] in llm.eos_token_ids
            ids = history + encode(("" if closed else "<|im_end|>") +
                                   f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n")
        out = llm.generate(ids, sp)[0]
        off = _uncached_tokens(llm, ids, sp, n)
        if out.token_ids != off:
            fail(f"turn {n + 1}: {message!r}", "its answer differs from caching off",
                 f"expected {off}, got {out.token_ids}", "a lookup returned blocks of another prefix")
        expected_hit = (len(history) - 1) // llm.block_size * llm.block_size if history else 0
        if out.num_cached_tokens < expected_hit:
            fail(f"turn {n + 1}: {message!r}", f"{out.num_cached_tokens} tokens came from the cache, expected at "
                 f"least {expected_hit}", "everything before this turn's message (the earlier turns and their "
                 "answers) is in the tree", "does the walk continue into a child after a whole edge matches?")
        history = ids + out.token_ids
    passed(len(turns), "with your match_prefix the chat's answers equal caching off, and every turn hits on the "
                       "turns before it")


def _uncached_tokens(llm, ids: list[int], sp, n: int) -> list[int]:
    """The same request under a salt nobody used: nothing can hit, exactly as with caching off."""
    return llm.generate({"prompt_token_ids": ids, "cache_salt": f"uncached-{n}"}, sp)[0].token_ids
