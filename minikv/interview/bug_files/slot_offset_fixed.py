"""Fixed: the offset inside a block comes from the absolute position, p % block_size, not from the
position's place in this step's chunk (a decode step writes one position, rarely at offset 0)."""


def slot_mapping(block_table, positions, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def engine_options() -> dict:
    return {"slot_mapping": slot_mapping}
