"""Shared by the engine tests: run the block manager's invariant checks after every engine step."""
from minikv import LLM


class InvariantCheck:
    """An observer (LLM.add_observer): refcounts == block-table membership, and the prefix cache's own
    bookkeeping, verified after every engine step."""

    def on_step(self, llm: LLM, batch, events) -> None:
        llm.block_manager.check(llm.scheduler.all_sequences())


def checked(llm: LLM) -> LLM:
    """Watch llm with InvariantCheck; returns the same engine."""
    llm.add_observer(InvariantCheck())
    return llm
