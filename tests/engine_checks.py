"""Shared by the engine tests: run the block manager's invariant checks after every engine step."""
from minikv import LLM


def checked(llm: LLM) -> LLM:
    """Wrap llm.step so that refcounts == block-table membership (and the prefix cache's own
    bookkeeping) is verified after every step; returns the same engine."""
    step = llm.step

    def step_and_check():
        events = step()
        llm.block_manager.check(llm.scheduler.all_sequences())
        return events

    llm.step = step_and_check
    return llm
