"""generate() shows a progress bar (requests done, tokens per second) for many requests on a terminal,
and nothing at all in notebooks, tests and logs (stderr not a terminal) or for a few requests."""
import io

import pytest

from minikv import LLM, SamplingParams
from minikv.engine import llm as llm_module

PROMPTS = [[1 + i, 2, 3] for i in range(16)]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", kv_backend="paged", block_size=4, num_blocks=64, max_num_seqs=8)


def test_many_requests_on_a_terminal_show_requests_done_and_tokens_per_second(llm, monkeypatch):
    err = Terminal()
    monkeypatch.setattr(llm_module.sys, "stderr", err)
    outs = llm.generate(PROMPTS, PARAMS)
    shown = err.getvalue()
    assert "16/16" in shown and "tok/s" in shown and "generate" in shown
    assert [len(o.token_ids) for o in outs] == [3] * 16


def test_no_bar_when_stderr_is_not_a_terminal_as_in_notebooks_and_tests(llm, monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(llm_module.sys, "stderr", err)
    llm.generate(PROMPTS, PARAMS)
    assert err.getvalue() == ""


def test_no_bar_for_a_few_requests_and_the_flag_decides_when_given(llm, monkeypatch):
    err = Terminal()
    monkeypatch.setattr(llm_module.sys, "stderr", err)
    llm.generate(PROMPTS[:llm_module.PROGRESS_MIN_REQUESTS - 1], PARAMS)
    assert err.getvalue() == ""
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert err.getvalue() == ""
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True, n=2), use_tqdm=True)
    assert "2/2" in err.getvalue()  # a request with two samples counts once, when both are done
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm="yes")
