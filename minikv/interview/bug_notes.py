"""What each bug lab prints on request and after FIXED: hints, the root cause, the regression test an
engineer would add, and where the same bug was seen in real engines (with the upstream link).

Kept apart from the lab files so that `minikv bugs start` shows the symptom only.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Notes:
    hints: tuple[str, ...]  # level 1: the tools to localize it; level 2: where to look
    cause: str
    regression: str
    field: str  # where this bug (or its family) was seen in real engines
    links: tuple[str, ...]


NOTES: dict[str, Notes] = {
    "stale-prefix-entry": Notes(
        ("Run the same requests with prefix_caching=None (caching must never change the tokens) and find the "
         "first request that differs; call llm.view.check() after every request (the pool's and the cache's "
         "invariants); print llm.prefix_cache.stats() and compare `table` with `by_block`.",
         "The cache has two indexes: key -> entry (table) and block -> entry (by_block). Eviction hands the block "
         "back to the pool, which gives it to another request. Which index still names the old block?"),
        "evict() removed the block from by_block but left its key in table: a later lookup of the old prefix "
        "returns a block that now holds another request's K/V (a wrong answer), or nothing at all (the block "
        "manager refuses to share a free block: the crash).",
        "Fill a small pool with prompt A, push A's blocks out with other prompts, send A again: its tokens must "
        "equal an engine without caching, and the cache's check() (table and by_block name the same blocks) "
        "must hold after every request.",
        "Prefix caches with two indexes keep getting this wrong: kvcached's vLLM block pool left a stale "
        "block_hash on evicted blocks, so a reused block kept its old identity (issue and fix below); vLLM "
        "itself had a superseded partial-block hash resurrected into its cache index.",
        ("https://github.com/ovg-project/kvcached/issues/362", "https://github.com/ovg-project/kvcached/pull/363",
         "https://github.com/vllm-project/vllm/issues/49125")),
    "full-prompt-hit": Notes(
        ("Print llm.prefix_cache.match(ids) and, from an observer's on_schedule, each sequence's "
         "num_computed_tokens against its num_tokens when it is admitted.",
         "The first output token is sampled from the logits of the last prompt position. If every prompt "
         "token is served from the cache, what does the forward compute?"),
        "A hit may cover at most num_tokens - 1 tokens: the last prompt token must be computed so that its "
        "logits give the first output token. With every block reused, nothing is left to prefill and the "
        "scheduler can run nothing.",
        "Send a prompt whose length is a multiple of block_size twice; the second must finish with "
        "num_cached_tokens = len - block_size (whole blocks, the last one recomputed).",
        "vLLM recomputes the whole last block on a full hit (V1 PR below) and later capped the hit length at "
        "num_tokens - 1; LMCache's connector crashed vLLM's scheduler (`assert num_new_tokens > 0`) on a "
        "full-prompt hit until it reported N - 1 tokens.",
        ("https://github.com/vllm-project/vllm/pull/11186", "https://github.com/vllm-project/vllm/pull/17999",
         "https://github.com/LMCache/LMCache/pull/3322")),
    "salt-last-block": Notes(
        ("Send one prompt as alice, then as bob, then as alice again, and print each output's "
         "num_cached_tokens.",
         "A block's key hashes its parent's key. Which block's key must the salt enter so that every later "
         "key differs between tenants?"),
        "The salt was mixed into the last block's key only, so the prefix blocks' keys were the same for every "
        "tenant and the prefix was shared across tenants: a timing side channel (time to first token tells bob "
        "what alice sent).",
        "Same prompt under two salts: the second tenant reuses 0 tokens, the first tenant's second request "
        "reuses its whole blocks (isolation, not caching off).",
        "vLLM added cache_salt for this side channel (CVE-2025-46570): the salt enters the first block's hash "
        "and flows down the chain.",
        ("https://github.com/vllm-project/vllm/pull/17045", "https://github.com/vllm-project/vllm/issues/16016")),
    "duplicate-prefix-blocks": Notes(
        ("Record the pool step by step (minikv.viz.pool.record_trace and step_lines) for three requests that "
         "share a new 16-token prefix and arrive together; compare their block tables after the first step "
         "with llm.prefix_cache.table.",
         "All three computed the same blocks in one step. When insert finds the key already cached under "
         "another block, what should it tell the engine to do with this request's copy?"),
        "insert() ignored a key already cached under another block, so requests that computed the same new "
        "prefix in the same step each kept a private copy: KV use as if nothing were shared.",
        "Three requests sharing a new prefix in one step: after the step they hold the same physical blocks "
        "for the prefix, and the pool's used blocks count the prefix once.",
        "nano-vllm's hash table overwrote the entry when two sequences cached the same prefix in one step "
        "(duplicate blocks); kvcached's block pool mishandled two physical blocks with one hash until it kept "
        "both. vLLM keeps the duplicates and reuses the first block on later hits.",
        ("https://github.com/GeeeekExplorer/nano-vllm/issues/219", "https://github.com/ovg-project/kvcached/pull/402",
         "https://github.com/vllm-project/vllm/pull/9668")),
    "cow-decrement-first": Notes(
        ("Compare llm.generate(prompt, SamplingParams(n=2, ...)) with the engine's own rule "
         "(llm.derive(copy_on_write=None)); print llm.stats()['cow_copies'] for both; call llm.view.check() "
         "from an observer after every step.",
         "With two sharers, ref_count is 2. Follow the first sample through the rule: what does it compare, "
         "after the decrement?"),
        "The rule let go of the block (ref_count -= 1) before asking whether others still read it, so with two "
        "sharers it saw 1 and wrote in place into the block the other sample still reads.",
        "Fork a request with a partial last block into n = 2 samples: each sample's tokens equal the sample run "
        "alone with its seed, and exactly one copy is made per shared block written.",
        "vLLM's old block manager decremented a shared block's ref_count in append_slot and freed it again "
        "later (a double free with shared blocks and a sliding window); the fix made each sequence drop each "
        "reference exactly once.",
        ("https://github.com/vllm-project/vllm/pull/3347",)),
    "decode-reads-past-len": Notes(
        ("Generate with the naive engine (kv_backend='naive') and compare token by token; inside decode_step "
         "print pos and the shape of what the scores are computed over.",
         "The cache row holds positions [0, pos] of this request and whatever an earlier request left after "
         "them. Which slice must the scores cover?"),
        "The step attended over one slot past pos: a stale or zero K/V entered the softmax.",
        "Run a long request, then a short one in the same cache row: the short one's tokens equal the naive "
        "engine's.",
        "Off-by-one context lengths are the classic paged/contiguous attention bug: vLLM's attention "
        "metadata carries seq_lens separately from the cache size for this reason (see its FlashAttention "
        "backend's metadata builder).",
        ("https://github.com/vllm-project/vllm/blob/main/vllm/v1/attention/backends/flash_attn.py",)),
    "missing-rescale": Notes(
        ("Call decode_step by hand on a random cache row of 20 positions and compare with "
         "torch.softmax(scores) @ values; find the first tile after which the two disagree.",
         "When a tile raises the running max from m to m_new, everything summed so far was weighted by "
         "exp(s - m). What must it be multiplied by to be weighted by exp(s - m_new)?"),
        "When a tile raised the running max, the running sum l and accumulator acc kept their old scale "
        "exp(-m_old); they must be multiplied by exp(m_old - m_new) before the tile is added. Contexts within "
        "one tile never raise the max after the first tile, so short chats were right.",
        "Random cache rows longer than several tiles, with scores large enough that exp overflows without a "
        "running max (q scaled up): the tiled step equals softmax(scores) @ values, with no NaN.",
        "Online-softmax merges are where fused attention kernels break: tilelang's flash-decoding example "
        "returned NaN from its split merge's max handling. The rescale is the heart of FlashAttention's "
        "algorithm (Dao et al.).",
        ("https://github.com/tile-ai/tilelang/issues/328", "https://github.com/Dao-AILab/flash-attention")),
    "slot-offset": Notes(
        ("Record the pool step by step (minikv.viz.pool.record_trace, step_lines) and look at the slots a "
         "decode step writes; call slot_mapping([7, 2, 9], [9], 4) by hand.",
         "Position 9 with block_size 4 lives in the block at index 9 // 4 of the table, at offset 9 % 4. "
         "Which of the two did the code compute from the chunk instead of the position?"),
        "The offset inside the block was taken relative to the chunk being computed, not the absolute "
        "position; a prefill starts at position 0 so it was right, decode steps were not.",
        "Decode steps across block boundaries: slot_mapping(table, [p], bs) == table[p // bs] * bs + p % bs "
        "for every p, and the paged engine's tokens equal the contiguous engine's.",
        "vLLM computes slot_mapping on the GPU from absolute positions and the block table (its model "
        "runner's input preparation); chunked prefill is where a chunk-relative offset would break it.",
        ("https://github.com/vllm-project/vllm/blob/main/vllm/v1/worker/gpu_model_runner.py",)),
    "allocator-double-hand": Notes(
        ("Drive the allocator by hand (allocate every block, free the newest, allocate again) and keep a set "
         "of the blocks handed out; run minikv.checks.paged.check_block_allocator(BumpAllocator).",
         "A freed block must become allocatable exactly once. Where can the newest freed block sit after free()?"),
        "free() of the block just below the bump pointer moved the pointer back and also put the block on the "
        "free list, so the block was handed to two requests: both wrote into it.",
        "Allocate, free and allocate at random against a set of outstanding blocks: no block is handed out "
        "twice, num_free_blocks matches, and an engine under preemption keeps its invariants.",
        "LMCache's paged allocator accepted the same page twice on its free list, so two callers got the same "
        "live KV page and overwrote each other.",
        ("https://github.com/LMCache/LMCache/issues/5005",)),
    "stale-after-weight-update": Notes(
        ("After the update and the reset, print llm.prefix_cache.stats() and the num_cached_tokens of the next "
         "request; compare with an engine built on the new weights with prefix_caching=None.",
         "reset_prefix_cache() must forget every cached block. What does the team's _clear() keep?"),
        "The cache kept its entries across reset_prefix_cache(), so K/V computed by the old weights were "
        "served after an update.",
        "Generate, update the weights in place, reset the prefix cache, generate again: tokens equal a fresh "
        "engine's on the new weights, and the request right after the reset reuses 0 tokens.",
        "RL frameworks hit this with vLLM: prefix caching served KV of the old policy after load_weights until "
        "a cache flush was added and called; lmdeploy had the same bug with /update_weights.",
        ("https://github.com/vllm-project/vllm/issues/9744", "https://github.com/InternLM/lmdeploy/issues/4917")),
    "causal-mask-peek": Notes(
        ("Call causal_attention on q, k, v of 4 positions where v[j] = j (a ramp) and read which positions each "
         "output row averages; minikv.checks.check_causal_attention(causal_attention) names the first wrong "
         "position and head.",
         "Row i may see columns 0..i. Which diagonal does the mask start at?"),
        "The mask started one diagonal too high: each position attended to the next one, so training-style "
        "loss looked too good and generation disagreed with the reference.",
        "For random lengths, each output row equals attention over positions 0..i only (a ramp value test "
        "shows it at a glance).",
        "torch.triu's diagonal argument is the usual trap (triu(ones, diagonal=1) masks the future; "
        "diagonal=2 lets one future token through).",
        ("https://pytorch.org/docs/stable/generated/torch.triu.html",)),
}
