"""Bug lab: the paged engine's first token is right, the rest are not.

Our slot mapping (plugged in with LLM(..., kv_backend="paged", slot_mapping=...)) is below. Prompts
prefill correctly and the first generated token equals the contiguous engine's; from the second token
on, answers drift.

Stuck? `minikv bugs hint slot-offset` gives a first hint; `--level 2` a closer one.

    minikv bugs check slot-offset
"""


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """The physical slot of each position this step writes (positions are consecutive)."""
    first = positions[0]
    return [block_table[p // block_size] * block_size + (p - first) % block_size for p in positions]


def engine_options() -> dict:
    return {"slot_mapping": slot_mapping}
