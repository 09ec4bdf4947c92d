"""A saved notebook shows each widget of notebooks 00-04 as a sentence, its answer and its picture, never
as `VBox(children=...)`: the fallback a viewer without a kernel (or an untrusted notebook) displays."""
from __future__ import annotations

import base64

import matplotlib

matplotlib.use("Agg")

from minikv import LLM, SamplingParams
from minikv.engine.static_batching import StaticBatcher
from minikv.viz.batching import batch_grid_browser
from minikv.viz.memory import kv_calculator
from minikv.viz.pool import pool_widget, record_trace

PNG_MAGIC = b"\x89PNG"


def saved(widget) -> dict:
    """What Jupyter writes into the notebook for this widget's output."""
    return widget._repr_mimebundle_()


def test_calculator_fallback_is_a_sentence_and_the_current_answer():
    calc = kv_calculator()
    data = saved(calc)
    assert "application/vnd.jupyter.widget-view+json" in data  # the live view is still there
    text = data["text/plain"]
    assert text.startswith("[interactive view: a KV-cache calculator") and "VBox" not in text
    assert "per token: 2 x 80 x 8 x 128 x 2 B = 320.00 KiB" in text
    calc.children[1].value = 4096  # the context slider: the fallback follows the widget
    assert "1 x 4,096 tokens: 1.25 GiB" in saved(calc)["text/plain"]


def test_pool_and_batch_views_save_their_picture():
    llm = LLM("tiny-random", kv_backend="paged", num_blocks=16, block_size=4, max_num_seqs=2)
    trace = record_trace(llm, [[3, 4, 5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=4, ignore_eos=True))
    data = saved(pool_widget(trace, step=1))
    assert data["text/plain"].startswith(f"[interactive view: a slider over the {len(trace)} steps")
    assert "step 1:" in data["text/plain"]
    assert base64.b64decode(data["image/png"]).startswith(PNG_MAGIC)

    batcher = StaticBatcher(LLM("tiny-random", kv_backend="contiguous", max_num_seqs=1), batch_size=1)
    batcher.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    browser = batch_grid_browser(batcher.stats)
    first = saved(browser)["image/png"]
    browser.children[0].value = 1
    data = saved(browser)
    assert "showing batch 1" in data["text/plain"] and data["image/png"] != first
    assert base64.b64decode(data["image/png"]).startswith(PNG_MAGIC)
