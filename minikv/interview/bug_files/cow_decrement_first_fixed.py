"""Fixed: look at ref_count BEFORE letting go: a block anyone else holds (ref_count > 1) is copied."""


def copy_on_write(block_table, ref_count, num_computed_tokens, num_tokens, block_size, allocate):
    copies = []
    first, last = num_computed_tokens // block_size, min(len(block_table), -(-num_tokens // block_size))
    for i in range(first, last):
        src = block_table[i]
        if ref_count[src] > 1:
            dst = allocate()
            ref_count[dst] = 1
            ref_count[src] -= 1
            block_table[i] = dst
            copies.append((src, dst))
    return copies


def engine_options() -> dict:
    return {"copy_on_write": copy_on_write}
