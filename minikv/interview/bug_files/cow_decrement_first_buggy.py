"""Bug lab: parallel samples (n > 1) come out garbled, but each alone is fine.

A request with SamplingParams(n=2, seed=...) gives two samples; run sample i alone with seed + i and
it differs from sample i of the group. Beams go wrong the same way. Single requests are fine. Our
copy-on-write rule, plugged in with LLM(..., copy_on_write=...), is below. Keep the rule (the
engine's default is not an option here: this rule is the team's), and copy only what must be copied.

Stuck? `minikv bugs hint cow-decrement-first` gives a first hint; `--level 2` a closer one.

    minikv bugs check cow-decrement-first
"""


def copy_on_write(block_table: list[int], ref_count: list[int], num_computed_tokens: int, num_tokens: int,
                  block_size: int, allocate) -> list[tuple[int, int]]:
    """Give the sequence private copies of the shared blocks that positions [num_computed_tokens, num_tokens)
    fall in; return the (src, dst) copies the runner makes before the forward."""
    copies = []
    first, last = num_computed_tokens // block_size, min(len(block_table), -(-num_tokens // block_size))
    for i in range(first, last):
        src = block_table[i]
        ref_count[src] -= 1  # this sequence lets go of the shared block ...
        if ref_count[src] > 1:  # ... and copies it if others still read it
            dst = allocate()
            ref_count[dst] = 1
            block_table[i] = dst
            copies.append((src, dst))
        else:
            ref_count[src] += 1  # nobody else: keep it and write in place
    return copies


def engine_options() -> dict:
    return {"copy_on_write": copy_on_write}
