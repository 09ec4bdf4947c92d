"""Reference for the speculative-rollback drill."""


def num_accepted(draft, p, q, u):
    n = 0
    for i, tok in enumerate(draft):
        pi, qi = float(p[i, tok]), float(q[i, tok])
        if qi > 0 and float(u[i]) >= min(1.0, pi / qi):
            break
        n += 1
    return n


def residual(p_row, q_row):
    r = (p_row - q_row).clamp(min=0)
    total = r.sum()
    return p_row.clone() if total <= 0 else r / total


def rollback(block_table, num_tokens, k, accepted, block_size, free):
    keep = (num_tokens + accepted + 1 + block_size - 1) // block_size
    while len(block_table) > keep:
        free(block_table.pop())
    return num_tokens + accepted
