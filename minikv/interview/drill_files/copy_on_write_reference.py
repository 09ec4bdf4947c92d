"""Reference for the copy-on-write drill."""


def copy_on_write(block_table, ref_count, start, end, block_size, allocate):
    copies = []
    last = min(len(block_table), -(-end // block_size))
    for i in range(start // block_size, last):
        src = block_table[i]
        if ref_count[src] <= 1:
            continue  # the last owner writes in place
        dst = allocate()
        ref_count[src] -= 1
        ref_count[dst] = 1
        block_table[i] = dst
        copies.append((src, dst))
    return copies
