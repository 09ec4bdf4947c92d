"""The hashed block chain (vLLM's automatic prefix caching).

Every FULL block gets a key that stands for its whole prefix, because it hashes its parent's key:

    tokens   [ t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49 ]   block_size 16
    key      k0 = H(None, t0..t15, (salt,))                       the salt enters the first block
             k1 = H(k0,   t16..t31, ())                           ... and flows down the chain
             k2 = H(k1,   t32..t47, ())
             (t48 t49: a partial block, never cached)

    table    {k0: block 7, k1: block 2, k2: block 9}              one dict lookup per block

A lookup hashes the request's blocks in order and stops at the first key not in the table. Change
one early token and every later key changes: a prefix cache reuses prefixes, nothing else.

H is sha256 over a fixed byte form, stable across processes (Python's `hash()` is salted per
process). Each entry also stores what it hashed, and a hit compares it, so even a hash collision
cannot serve another prefix's K/V.

Unused cached blocks wait in a free queue (LRU: least recently released first). A finished
request releases its blocks tail first, so its last blocks are evicted before its prefix: the
prefix is what the next request is most likely to share.
"""
from __future__ import annotations

import hashlib
import itertools
import operator
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

from minikv.cache.blocks.block_table import CachedRequest, TokenIds
from minikv.cache.prefix.base import EvictionQueue, PrefixCache, PrefixMatch

BlockHash = bytes
HashFn = Callable[[BlockHash | None, tuple, tuple], BlockHash]


def id_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as 8 little-endian bytes each (any integer type: int, numpy, a 0-d tensor). A float is
    refused, never truncated."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as e:
        raise TypeError(f"token ids must be integers that fit in 64 bits ({e})") from None


def hash_block(parent: BlockHash | None, token_ids: TokenIds, extra_keys: tuple = ()) -> BlockHash:
    """Key of one full block: sha256 of (parent key, its token ids, its extra keys).

    The bytes hashed are framed so that no two inputs share them: a header (is there a parent, how
    many tokens), the parent's 32 bytes, each token id as 8 little-endian bytes, then the extra keys'
    repr. Token ids go in as machine integers, not as text: a 8,192-token hit hashes 512 blocks, and
    formatting each block's ids as text cost several times the sha256 itself."""
    tokens = id_bytes(token_ids)
    h = hashlib.sha256(struct.pack("<?I", parent is not None, len(tokens) // 8))
    if parent is not None:
        h.update(parent)
    h.update(tokens)
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def extra_keys(block_index: int, cache_salt: str | None = None) -> tuple:
    """What else, besides the tokens, decides a block's K/V. Only the first block carries the salt;
    every later key inherits it through its parent. (vLLM also puts LoRA ids and image hashes here.)"""
    if block_index == 0 and cache_salt is not None:
        return (("cache_salt", cache_salt),)
    return ()


def chain_keys(token_ids: TokenIds, block_size: int, num_blocks: int, cache_salt: str | None = None,
               parent: BlockHash | None = None) -> Iterator[BlockHash]:
    """hash_block's keys of the first `num_blocks` full blocks, chained, one at a time (a lookup stops
    at its first miss). The same bytes as hash_block, framed the same way, but the ids are converted
    once for all the blocks and each block hashes a slice of that buffer: a 8,192-token hit hashes 512
    blocks, and a conversion per block cost as much as the sha256 itself."""
    data = id_bytes(token_ids[:num_blocks * block_size])
    if len(data) < num_blocks * block_size * 8:
        raise ValueError(f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} token ids, "
                         f"got {len(data) // 8}")
    return _chain(data, block_size, num_blocks, extra_keys(0, cache_salt), parent)


def _chain(data: bytes, block_size: int, num_blocks: int, first_extra: tuple, parent: BlockHash | None
           ) -> Iterator[BlockHash]:
    """chain_keys from the ids' bytes (`id_bytes`): hash_block's frame, written out."""
    width, sha256 = 8 * block_size, hashlib.sha256
    with_parent = struct.pack("<?I", True, block_size)
    if num_blocks:  # the first block: perhaps no parent, perhaps the salt
        head = with_parent + parent if parent is not None else struct.pack("<?I", False, block_size)
        parent = sha256(head + data[:width] + (repr(tuple(first_extra)).encode() if first_extra else b"")).digest()
        yield parent
    for start in range(width, num_blocks * width, width):
        parent = sha256(with_parent + parent + data[start:start + width]).digest()
        yield parent


def _local_root(salt: str | None) -> int:
    """The local chain's parent of a first block: the salt goes in here, as it goes into the first key."""
    return hash(("minikv local chain", salt))


def block_hashes(token_ids: TokenIds, block_size: int, cache_salt: str | None = None,
                 hash_fn: HashFn = hash_block, parent: BlockHash | None = None) -> list[BlockHash]:
    """Keys of every full block of `token_ids`, chained from the first (or from `parent`, the key of
    the block before them: then pass no cache_salt, the parent carries it)."""
    if hash_fn is hash_block:
        return list(chain_keys(token_ids, block_size, len(token_ids) // block_size, cache_salt, parent))
    keys: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        parent = keys[-1] if keys else parent
        keys.append(hash_fn(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), extra_keys(i, cache_salt)))
    return keys


@dataclass(slots=True)
class CachedBlock:
    block: int  # physical block id
    key: BlockHash
    parent: BlockHash | None  # what was hashed, compared on every hit
    token_ids: tuple
    extra: tuple
    salt: str | None
    born: int  # clock when it entered the cache (FIFO)
    last_used: int  # clock when it was last used (LRU)
    token_bytes: bytes = b""  # token_ids as id_bytes gives them (filled in when not given)
    local_key: int | None = None  # its key in the lookup's local index, once a lookup has found it

    def __post_init__(self) -> None:
        if not self.token_bytes:
            self.token_bytes = id_bytes(self.token_ids)  # a hit compares a whole chain's bytes at once


SPAN = 32  # blocks of one entry of the lookup's span index (512 tokens at block size 16)


@dataclass
class Span:
    """`span` consecutive cached blocks of one chain, from a block index that is a multiple of it: a long
    hit is walked a span at a time. Made from a verified chain, and valid while every entry is cached."""
    entries: list[CachedBlock]
    blocks: list[int]
    data: bytes  # the entries' id bytes, compared with the request's on every walk through the span

    def cached_in(self, by_block: dict[int, CachedBlock]) -> bool:
        """Is every entry still the cached one of its block? (A span with one gone is stale: never walked.)"""
        return all(map(operator.is_, map(by_block.get, self.blocks), self.entries))


class FreeQueueSeam:
    """A learner's free block queue (exercise 06d: append, remove, popleft, len, in, iter; least recently
    used first) behind the interface HashChainCache uses (EvictionQueue's). With LRU the priority pushed
    is the newest time, so a push is an append at the back (a block unpinned keeps its older time in
    EvictionQueue, here it joins the back). The queue is made on first use: building an engine never
    calls the learner's code."""

    def __init__(self, queue_cls: Callable[[], object]) -> None:
        self.queue_cls, self._queue = queue_cls, None
        self._priority: dict[int, int] = {}  # queued block -> its time (what check() compares)

    @property
    def queue(self):
        if self._queue is None:
            self._queue = self.queue_cls()
        return self._queue

    def push(self, block: int, priority: int) -> None:
        if block in self.queue:
            self.queue.remove(block)
        self.queue.append(block)
        self._priority[block] = priority

    def discard(self, block: int) -> None:
        if block in self.queue:
            self.queue.remove(block)
        self._priority.pop(block, None)

    def pop(self) -> int:
        block = self.queue.popleft()
        if block not in self._priority:
            raise ValueError(f"free_block_queue: popleft() returned {block!r}, which is not a queued block "
                             f"(queued: {sorted(self._priority)}); it must remove and return the front block")
        del self._priority[block]
        return block

    def priority(self, block: int) -> int:
        return self._priority[block]

    def ordered(self) -> list[int]:
        return list(self.queue)

    def __contains__(self, block: int) -> bool:
        return block in self.queue

    def __len__(self) -> int:
        return len(self.queue)


class HashChainCache(PrefixCache):
    """free_queue: a learner's queue class (exercise 06d, `LLM(..., free_block_queue=cls)`) keeps the
    unused cached blocks in place of the cache's own EvictionQueue (LRU only)."""

    design = "hash"
    span = SPAN  # blocks of one span of the lookup's index (a class attribute: the tests take shorter spans)

    def __init__(self, block_size: int, eviction: str = "lru", hash_fn: HashFn = hash_block,
                 free_queue: Callable[[], object] | None = None):
        super().__init__(block_size, eviction)
        if free_queue is not None and eviction != "lru":
            raise ValueError(f"a free_block_queue evicts the least recently used block first; build the engine "
                             f"with eviction='lru' (got {eviction!r}) to use it")
        self.hash_fn = hash_fn
        self.free_queue_cls = free_queue
        self.table: dict[BlockHash, CachedBlock] = {}  # key -> entry
        self.by_block: dict[int, CachedBlock] = {}  # physical block -> entry
        self.free_queue = self._new_free_queue()  # unused, unpinned cached blocks, next to evict first
        self._seq_keys: dict[int, list[BlockHash]] = {}  # seq_id -> keys of its full blocks so far
        self._looked_up: dict[int, tuple] = {}  # seq_id -> (salt, keys, blocks) of its last lookup's hit, for insert
        self.local: dict[int, CachedBlock] = {}  # the lookup's own index: local chain key -> entry (see _match)
        self.spans: dict[int, Span] = {}  # the same index SPAN blocks at a time: (local key before, bytes) -> span
        self._live_spans = 0  # spans left by the last prune of those whose entries left the cache
        self.num_collisions = 0

    # ---- lookup ---------------------------------------------------------------------------------
    def _key(self, parent: BlockHash | None, token_ids: TokenIds, i: int, salt: str | None) -> tuple:
        bs = self.block_size
        toks, extra = tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys(i, salt)
        return self.hash_fn(parent, toks, extra), toks, extra

    def _same(self, entry: CachedBlock, parent: BlockHash | None, toks: tuple, extra: tuple) -> bool:
        if (entry.parent, entry.token_ids, entry.extra) == (parent, toks, extra):
            return True
        self.num_collisions += 1  # equal keys, different content: never serve it
        return False

    def match(self, token_ids: TokenIds, salt: str | None = None, max_tokens: int | None = None) -> PrefixMatch:
        return self._match(token_ids, salt, max_tokens)[0]

    def _match(self, token_ids: TokenIds, salt: str | None, max_tokens: int | None, data: bytes | None = None
               ) -> tuple[PrefixMatch, list[BlockHash]]:
        """The match, and the keys of its blocks (what `insert` would hash again for the same tokens).

        sha256 keys name a block beyond this process (the offload store, a peer engine), but finding a
        hit of 512 blocks by them means 512 sha256 calls in a Python loop. So a lookup first walks a
        local index: the same chain keyed by Python's own hash of (parent's local key, the block's id
        bytes), about three times cheaper per block and valid only in this process. Every entry a
        lookup found by its sha256 key joins that index, so from the second hit on a prefix is walked
        there, and the sha256 walk goes on only from where the local one stopped (one sha256 for the
        first block past a hit). An entry the local walk finds must still be in the cache, and what the
        found chain hashed is compared with the request at once, bytes and parents: a local key that
        collides costs a sha256 walk, never another prefix's K/V.

        The local walk takes SPAN blocks at a step where it can (`spans`, made from chains already
        verified): an 8,192-token hit is 16 spans, not 512 blocks. `data`: the ids' bytes, where the
        caller has them already (the prompt's, from the engine's range check)."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs, n = self.block_size, limit // self.block_size
        if self.hash_fn is not hash_block or n == 0:
            return self._match_each(token_ids, salt, n)
        width = 8 * bs
        data = data[:n * width] if data is not None and len(data) >= n * width else id_bytes(token_ids[:n * bs])
        found, local, spanned = self._walk_local(data, n, salt)
        if len(found) > spanned and not self._is_chain_of(found, data, salt, spanned):
            del found[spanned:]  # a local key collided past the spans: the sha256 walk decides from there
            local = found[-1].local_key if found else _local_root(salt)
        walked = len(found)
        parent = found[-1].key if found else None
        for key in _chain(data[walked * width:], bs, n - walked, () if found else extra_keys(0, salt), parent):
            entry = self.table.get(key)
            if entry is None:
                break
            found.append(entry)
        if len(found) > walked:
            if not self._is_chain_of(found, data, salt, walked):
                return self._match_each(token_ids, salt, len(found))
            for i in range(walked, len(found)):  # found by sha256: the local index learns them
                local = hash((local, data[i * width:(i + 1) * width]))
                found[i].local_key = local
                self.local[local] = found[i]
            if len(self.local) > 2 * len(self.by_block) + 1024:  # entries dropped by a subclass's own evict
                self.local = {k: e for k, e in self.local.items() if self.by_block.get(e.block) is e}
        if len(found) >= spanned + self.span:
            self._add_spans(found, data, salt, spanned)
        return PrefixMatch([e.block for e in found], len(found) * bs), [e.key for e in found]

    def _walk_local(self, data: bytes, num_blocks: int, salt: str | None) -> tuple[list[CachedBlock], int, int]:
        """The entries the local index holds for the chain of `data`, up to the first block it lacks (or
        whose entry has left the cache), the local key of the last one found, and how many of them came
        in whole spans (checked already: their bytes, their parents, every entry still cached)."""
        width, get, by_block = 8 * self.block_size, self.local.get, self.by_block
        found: list[CachedBlock] = []
        key, span_blocks = _local_root(salt), self.span
        step = span_blocks * width
        for start in range(0, num_blocks // span_blocks * step, step):
            chunk = data[start:start + step]
            span = self.spans.get(hash((key, chunk)))
            if (span is None or span.data != chunk or not span.cached_in(by_block)
                    or span.entries[0].parent != (found[-1].key if found else None)
                    or (not found and span.entries[0].extra != extra_keys(0, salt))):
                break
            found += span.entries
            key = span.entries[-1].local_key
        spanned = len(found)
        for start in range(spanned * width, num_blocks * width, width):
            entry = get(hash((key, data[start:start + width])))
            if entry is None or by_block.get(entry.block) is not entry:
                break
            found.append(entry)
            key = entry.local_key
        return found, key, spanned

    def _add_spans(self, found: list[CachedBlock], data: bytes, salt: str | None, start: int) -> None:
        """Spans for the verified chain `found` (every entry with its local key), from block `start` (a
        multiple of the span) on. Spans whose entries left the cache are dropped when they outnumber the rest."""
        width, n = 8 * self.block_size, self.span
        for i in range(start, len(found) - n + 1, n):
            entries = found[i:i + n]
            before = found[i - 1].local_key if i else _local_root(salt)
            chunk = data[i * width:(i + n) * width]
            self.spans[hash((before, chunk))] = Span(entries, [e.block for e in entries], chunk)
        if len(self.spans) > 2 * self._live_spans + 64:  # (a count that doubles between prunes: amortised O(1))
            by_block = self.by_block
            self.spans = {k: sp for k, sp in self.spans.items() if sp.cached_in(by_block)}
            self._live_spans = len(self.spans)

    def _is_chain_of(self, found: list[CachedBlock], data: bytes, salt: str | None, start: int = 0) -> bool:
        """Do these entries hold exactly the chain of `data` (its first len(found) blocks) with this salt?
        Their ids, their parents' keys and their extra keys, compared for the whole chain at once; from
        block `start` on where the blocks before it were checked already."""
        width, part = 8 * self.block_size, found[start:]
        keys = [e.key for e in found[max(start - 1, 0):]]
        return (b"".join([e.token_bytes for e in part]) == data[start * width:len(found) * width]
                and [e.parent for e in part] == ([None] if start == 0 else []) + keys[:len(part) - (start == 0)]
                and (start > 0 or found[0].extra == extra_keys(0, salt))
                and not any(e.extra for e in found[max(start, 1):]))

    def _match_each(self, token_ids: TokenIds, salt: str | None, num_blocks: int
                    ) -> tuple[PrefixMatch, list[BlockHash]]:
        """`_match` one block at a time: hash it, look it up, compare what the entry hashed."""
        blocks: list[int] = []
        keys: list[BlockHash] = []
        parent = None
        for i in range(num_blocks):
            key, toks, extra = self._key(parent, token_ids, i, salt)
            entry = self.table.get(key)
            if entry is None or not self._same(entry, parent, toks, extra):
                break
            blocks.append(entry.block)
            keys.append(key)
            parent = key
        return PrefixMatch(blocks, len(blocks) * self.block_size), keys

    def lookup(self, seq: CachedRequest) -> PrefixMatch:
        """As every prefix cache's, and the chain keys of the hit are kept for the sequence's `insert`: a
        key depends only on the tokens and the salt, so a long hit's prefix is hashed once, not twice."""
        if not self.enabled:
            return PrefixMatch()
        if type(self).match is not HashChainCache.match:  # a subclass's own match decides (a lab's, a learner's)
            return super().lookup(seq)
        prompt, data = getattr(seq, "prompt_token_ids", None), getattr(seq, "prompt_bytes", None)
        if data is not None and prompt is not None and len(data) == 8 * len(prompt) >= 8 * (seq.num_tokens - 1):
            hit, keys = self._match(prompt, seq.cache_salt, seq.num_tokens - 1, data)  # the prompt's bytes, kept
        else:
            hit, keys = self._match(seq.token_ids, seq.cache_salt, seq.num_tokens - 1)
        if keys:
            self._looked_up[seq.seq_id] = (seq.cache_salt, keys, hit.blocks)
            while len(self._looked_up) > 1024:  # sequences looked up and never inserted: keep the newest
                self._looked_up.pop(next(iter(self._looked_up)))
        else:  # an earlier lookup's hit may be gone since (evicted, its blocks reused): never trust it
            self._looked_up.pop(seq.seq_id, None)
        return hit

    def touch(self, blocks: list[int]) -> None:
        now = self.tick()
        for b in blocks:
            self.by_block[b].last_used = now

    def key_of(self, block: int) -> BlockHash | None:
        """The chain key a cached block is stored under (None: not cached)."""
        entry = self.by_block.get(block)
        return entry.key if entry is not None else None

    # ---- filling --------------------------------------------------------------------------------
    def insert(self, seq: CachedRequest) -> dict[int, int]:
        if not self.enabled:
            return {}
        keys = self._seq_keys.setdefault(seq.seq_id, [])
        adopt: dict[int, int] = {}
        first, end = len(keys), seq.num_computed_tokens // self.block_size
        salt, known, hit = self._looked_up.pop(seq.seq_id, (None, (), ()))
        if salt != seq.cache_salt:
            known = hit = ()
        if (first == 0 and hit and len(hit) <= end and seq.block_table[:len(hit)] == hit
                and all(self.key_of(hit[j]) == known[j] for j in (0, -1))):
            # the hit's own blocks, cached under these keys already: the sequence took them right after its
            # lookup (every admission looks up again) and has held them since, so none was evicted
            keys.extend(known)
            first = len(hit)
        if first >= end:
            return adopt
        if self.hash_fn is hash_block and type(self)._key is HashChainCache._key:
            return self._insert_chain(seq, keys, first, end, known, adopt)
        bs, token_ids = self.block_size, seq.token_ids  # built once: a new list of the whole sequence
        for i in range(first, end):
            parent = keys[-1] if keys else None
            if i < len(known):  # hashed by this sequence's lookup: the same tokens, the same salt
                key, toks, extra = known[i], tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys(i, seq.cache_salt)
            else:
                key, toks, extra = self._key(parent, token_ids, i, seq.cache_salt)
            keys.append(key)
            if not self._offer(seq, i, key, parent, toks, extra, adopt):
                keys.pop()
                break
        return adopt

    def _insert_chain(self, seq: CachedRequest, keys: list[BlockHash], first: int, end: int, known: tuple,
                      adopt: dict[int, int]) -> dict[int, int]:
        """`insert` of blocks [first, end) with hash_block's keys, made as a lookup makes them: the ids of
        those blocks alone (a decode's one block: not a list of the whole sequence), converted to bytes once
        (the prompt's are kept already), then chained (`_chain`). The same keys, entries and adoptions as
        the block-by-block loop above, which a subclass's own `_key` or `hash_fn` still takes."""
        bs, salt = self.block_size, seq.cache_salt
        width, lo, hi = 8 * bs, first * bs, end * bs
        prompt, output = getattr(seq, "prompt_token_ids", None), getattr(seq, "output_token_ids", None)
        if prompt is None or output is None:
            ids = seq.token_ids[lo:hi]
        elif hi <= len(prompt):
            ids = prompt[lo:hi]
        else:
            ids = prompt[lo:hi] + output[max(lo - len(prompt), 0):hi - len(prompt)]
        data = getattr(seq, "prompt_bytes", None)
        if data is not None and prompt is not None and hi <= len(prompt) and len(data) == 8 * len(prompt):
            data = data[lo * 8:hi * 8]
        else:
            data = id_bytes(ids)
        reuse = max(0, min(end, len(known)) - first)  # hashed by this sequence's lookup: the same tokens, salt
        chained_from = known[first + reuse - 1] if reuse else (keys[-1] if keys else None)  # the key before them
        chained = _chain(data[reuse * width:], bs, end - first - reuse, extra_keys(0, salt) if first + reuse == 0
                         else (), chained_from)
        parent = keys[-1] if keys else None
        for j, key in enumerate(itertools.chain(known[first:first + reuse], chained)):
            i = first + j
            keys.append(key)
            entry_bytes = data[j * width:(j + 1) * width]
            if not self._offer(seq, i, key, parent, tuple(ids[j * bs:(j + 1) * bs]), extra_keys(i, salt), adopt,
                               entry_bytes):
                keys.pop()
                break
            parent = key
        return adopt

    def _offer(self, seq: CachedRequest, i: int, key: BlockHash, parent: BlockHash | None, toks: tuple,
               extra: tuple, adopt: dict[int, int], token_bytes: bytes = b"") -> bool:
        """Block i of seq joins the cache under `key`, or, computed twice (two requests in flight), the
        cached copy goes in `adopt`. False: the block was given back (a sliding window) before it was
        offered, and so were the ones after it."""
        block, entry = seq.block_table[i], self.table.get(key)
        if block < 0:
            return False
        if entry is None:
            if block not in self.by_block:
                now = self.tick()
                self.table[key] = self.by_block[block] = CachedBlock(block, key, parent, toks, extra,
                                                                     seq.cache_salt, now, now, token_bytes)
        elif entry.block != block and self._same(entry, parent, toks, extra):
            adopt[i] = entry.block  # keep one copy
        return True

    def forget(self, seq: CachedRequest) -> None:
        self._seq_keys.pop(seq.seq_id, None)
        self._looked_up.pop(seq.seq_id, None)

    # ---- unused blocks --------------------------------------------------------------------------
    def holds(self, block: int) -> bool:
        return block in self.by_block

    def _priority(self, entry: CachedBlock) -> int:
        return entry.last_used if self.eviction == "lru" else entry.born

    def keep(self, block: int) -> bool:
        entry = self.by_block.get(block)
        if entry is None:
            return False
        entry.last_used = self.tick()  # blocks freed tail first: the tail gets the older time
        if block not in self.pinned:
            self.free_queue.push(block, self._priority(entry))
        return True

    def take(self, block: int) -> None:
        self.free_queue.discard(block)

    @property
    def num_evictable(self) -> int:
        return len(self.free_queue)

    def evict(self, num_blocks: int) -> list[int]:
        out, keys = [], []
        while len(out) < num_blocks and len(self.free_queue):
            block = self.free_queue.pop()
            entry = self.by_block.pop(block)
            del self.table[entry.key]  # later blocks of the chain stay, unreachable until it returns
            if self.local.get(entry.local_key) is entry:
                del self.local[entry.local_key]
            out.append(block)
            keys.append((block, entry.key))
        self.num_evicted += len(out)
        if self.on_evict is not None and keys:
            self.on_evict(keys)  # a store below the pool takes their bytes before they are reused
        return out

    def cached_blocks(self) -> list[int]:
        return list(self.by_block)

    def _on_pin(self, block: int) -> None:
        self.free_queue.discard(block)

    def _on_unpin(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self.free_queue.push(block, self._priority(self.by_block[block]))

    def _new_free_queue(self) -> EvictionQueue | FreeQueueSeam:
        return EvictionQueue() if self.free_queue_cls is None else FreeQueueSeam(self.free_queue_cls)

    def _clear(self) -> None:
        self.table.clear()
        self.by_block.clear()
        self.local.clear()
        self.spans.clear()
        self._live_spans = 0
        self.free_queue = self._new_free_queue()
        self._seq_keys.clear()
        self._looked_up.clear()

    def salt_of(self, block: int) -> str | None:
        return self.by_block[block].salt

    # ---- invariants -----------------------------------------------------------------------------
    def check(self, seqs=()) -> None:
        """Table and block index agree; the free queue is exactly the unused unpinned blocks; each
        sequence's cached blocks sit under the keys of its own tokens; salts never cross."""
        seqs = list(seqs)
        super().check(seqs)
        for key, entry in self.table.items():
            if entry.key != key or self.by_block.get(entry.block) is not entry:
                raise AssertionError(f"table entry {key.hex()[:8]} and block {entry.block} disagree")
        if len(self.table) != len(self.by_block):
            raise AssertionError(f"{len(self.table)} keys but {len(self.by_block)} cached blocks")
        for key, entry in self.local.items():
            if self.by_block.get(entry.block) is not entry or entry.local_key != key:
                raise AssertionError(f"the local index holds block {entry.block}, which left the cache or sits "
                                     "under another local key")
        for span in self.spans.values():  # a span with an entry gone is stale (never walked), else it is exact
            entries = span.entries
            if span.cached_in(self.by_block) and (
                    b"".join(e.token_bytes for e in entries) != span.data or span.blocks != [e.block for e in entries]
                    or any(e.parent != p.key for p, e in zip(entries, entries[1:]))):
                raise AssertionError(f"a span from block {span.blocks[0]} does not hold its entries' chain")
        for b in self.free_queue.ordered():
            if self.free_queue.priority(b) != self._priority(self.by_block[b]):
                raise AssertionError(f"block {b} sits in the free queue with a stale {self.eviction} time")
        queued = set(self.free_queue.ordered())
        unused = {b for b in self.by_block if self.is_unused(b)}
        if queued != unused:
            raise AssertionError(f"free queue holds {sorted(queued)} but the unused cached blocks are {sorted(unused)}")
        for s in seqs:
            for i, key in enumerate(self._seq_keys.get(s.seq_id, [])):
                entry = self.by_block.get(s.block_table[i]) if i < len(s.block_table) else None
                if entry is not None and entry.key != key:
                    raise AssertionError(f"request {s.request_id}: block {entry.block} at index {i} is cached "
                                         "under another prefix's key")
