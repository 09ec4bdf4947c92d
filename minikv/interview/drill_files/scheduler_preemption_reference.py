"""Reference for the scheduler-preemption drill."""


def pick_victim(candidates):
    return max(candidates, key=lambda s: (s.priority, s.arrival))


def schedule_running(running, budget, free_blocks, block_size, preemption, swap_free_blocks):
    batch, preempted, gone = [], [], set()
    for seq in running:
        if seq.request_id in gone:
            continue
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n <= 0:
            continue
        need = max(0, -(-(seq.num_computed_tokens + n) // block_size) - seq.num_blocks)
        while need > free_blocks and seq.request_id not in gone:
            in_batch = {rid for rid, _ in batch}
            victim = pick_victim([s for s in running if s.request_id not in gone | in_batch])
            gone.add(victim.request_id)
            free_blocks += victim.num_blocks
            how = "swap" if preemption == "swap" and swap_free_blocks >= victim.num_blocks else "recompute"
            if how == "swap":
                swap_free_blocks -= victim.num_blocks
            preempted.append((victim.request_id, how))
        if seq.request_id in gone:
            continue
        free_blocks -= need
        budget -= n
        batch.append((seq.request_id, n))
    return batch, preempted
