"""Drill: speculative decoding: verify draft tokens, then roll back the KV of the rejected ones (30 minutes).

1. num_accepted(draft, p, q, u) -> int
       draft [k] token ids proposed by the draft model; p [k, V] the target's probabilities at each
       drafted position, q [k, V] the draft's; u [k] uniform numbers in [0, 1). Token i is accepted
       when u[i] < min(1, p[i, draft[i]] / q[i, draft[i]]); count accepted tokens up to the first
       rejection.

2. residual(p_row, q_row) -> [V]
       after a rejection the replacement is sampled from max(0, p - q) normalised to sum 1
       (p itself when p <= q everywhere): return that distribution.

3. rollback(block_table, num_tokens, k, accepted, block_size, free) -> num_computed_tokens
       before the step the sequence held num_tokens tokens, K/V cached for [0, num_tokens - 1);
       verification wrote K/V for [num_tokens - 1, num_tokens + k). Afterwards it holds
       num_tokens + accepted + 1 tokens, and [0, num_tokens + accepted) keep valid K/V: return that.
       Keep the ceil((num_tokens + accepted + 1) / block_size) blocks it needs; give every later block
       back with free(block), last first, popping it off block_table (in place).
   Example: num_tokens 8, k 4, accepted 0, block_size 4: the table had 3 blocks; keep 3 (9 tokens
   need 3 blocks), free nothing, return 8.

Check it with: minikv drill check speculative-rollback
In the engine: notebooks/13_speculative_decoding.ipynb (speculative="ngram" or "draft") and exercise
13a_rollback, whose rollback keeps only the blocks of computed positions, ceil(num_computed / block_size).
"""


def num_accepted(draft, p, q, u) -> int:
    raise NotImplementedError("write num_accepted")


def residual(p_row, q_row):
    raise NotImplementedError("write residual")


def rollback(block_table: list[int], num_tokens: int, k: int, accepted: int, block_size: int, free) -> int:
    raise NotImplementedError("write rollback")
