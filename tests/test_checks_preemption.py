"""Exercise 05b's checker (preemption: the victim, recompute or swap) passes the reference answers,
catches the mistakes learners make, and replays a real engine run under memory pressure step by step."""
from __future__ import annotations

import pytest

from minikv.checks.preemption import (
    PREEMPT_CASES,
    check_pick_victim,
    check_preemption_on_engine_run,
    check_schedule_running,
    reference_running,
)


def pick_victim(candidates):
    return max(candidates, key=lambda s: (s.priority, s.arrival))


def schedule_running(running, budget, free_blocks, block_size, preemption, swap_free_blocks,
                     victim_fn=pick_victim, exclude_batch=True, swap_needs_room=True, self_runs=False):
    batch, preempted, alive = [], [], list(running)
    for seq in running:
        if seq not in alive:
            continue
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if n == 0:
            continue
        need = max(0, -(-(seq.num_computed_tokens + n) // block_size) - seq.num_blocks)
        while need > free_blocks:
            placed = {r for r, _ in batch} if exclude_batch else set()
            victim = victim_fn([s for s in alive if s.request_id not in placed])
            alive.remove(victim)
            free_blocks += victim.num_blocks
            if preemption == "swap" and (swap_free_blocks >= victim.num_blocks or not swap_needs_room):
                swap_free_blocks -= victim.num_blocks
                preempted.append((victim.request_id, "swap"))
            else:
                preempted.append((victim.request_id, "recompute"))
            if victim is seq:
                if self_runs:
                    alive.append(seq)
                break
        if seq not in alive:
            continue
        free_blocks -= need
        batch.append((seq.request_id, n))
        budget -= n
    return batch, preempted


def test_task_05b_reference_answers_pass(capsys):
    check_pick_victim(pick_victim)
    check_schedule_running(schedule_running, num_random=150)
    assert capsys.readouterr().out.count("cases passed") == 2


@pytest.mark.parametrize("fn, words", [
    (lambda c: min(c, key=lambda s: (s.priority, s.arrival)), "picked 'a'"),
    (lambda c: c[-1], "picked 'b'"),  # the last in the list is not the newest
    (lambda c: max(c, key=lambda s: s.arrival), "picked 'c'"),  # priority ignored
    (lambda c: max(c, key=lambda s: (-s.priority, s.arrival)), "picked"),  # priority read backwards
])
def test_task_05b_victim_bugs_are_caught(fn, words):
    with pytest.raises(AssertionError, match=words):
        check_pick_victim(fn)


@pytest.mark.parametrize("kwargs, words", [
    (dict(victim_fn=lambda c: min(c, key=lambda s: (s.priority, s.arrival))), "preempted sequences differ"),
    (dict(exclude_batch=False), "already in this step's batch|preempted sequences differ"),
    (dict(swap_needs_room=False), "the wrong mode"),
    (dict(self_runs=True), "batch differs"),
])
def test_task_05b_schedule_running_bugs_are_caught(kwargs, words):
    with pytest.raises(AssertionError, match=words):
        check_schedule_running(lambda *a: schedule_running(*a, **kwargs), num_random=150)


def test_task_05b_always_recompute_is_caught_on_the_swap_case():
    with pytest.raises(AssertionError, match="the wrong mode"):
        check_schedule_running(lambda r, b, f, bs, mode, sw: schedule_running(r, b, f, bs, "recompute", sw))


def test_task_05b_the_taught_lessons_are_what_the_scheduler_does():
    """Each hand-picked case's lesson names who is preempted: it must be the engine's decision."""
    assert reference_running(PREEMPT_CASES[0])[1] == []
    assert reference_running(PREEMPT_CASES[1])[1] == [("c", "recompute")]
    assert reference_running(PREEMPT_CASES[2]) == ([("a", 1)], [("b", "recompute")])
    assert reference_running(PREEMPT_CASES[3]) == ([("a", 12)], [("c", "recompute"), ("b", "recompute")])
    assert reference_running(PREEMPT_CASES[4])[1] == [("a", "recompute")]
    assert reference_running(PREEMPT_CASES[5])[1] == [("c", "swap")]
    assert reference_running(PREEMPT_CASES[6])[1] == [("c", "recompute")]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_task_05b_engine_run_replays_with_the_reference(mode, capsys):
    stats = check_preemption_on_engine_run(schedule_running, preemption=mode)
    assert stats["num_preemptions"] > 0
    assert (stats["num_swaps"] > 0) == (mode == "swap")
    assert "at every step" in capsys.readouterr().out


def test_task_05b_engine_run_catches_a_wrong_victim():
    with pytest.raises(AssertionError, match="differs from the engine's"):
        check_preemption_on_engine_run(
            lambda *a: schedule_running(*a, victim_fn=lambda c: min(c, key=lambda s: (s.priority, s.arrival))))
