"""The ladder on a GPU, per dtype and path: paged Triton (with and without CUDA graphs, Triton or torch prefill)
against the contiguous rung, tiny-random, the ladder test's mixed requests. Run from the repository root:
`python benchmarks/ladder_dtype_probe.py`. Recorded in benchmarks/ladder_dtype_probe_h100.txt."""
import gc
import sys

import torch

sys.path.insert(0, "tests")
from minikv import LLM

from test_ladder import mixed_requests

prompts, params = mixed_requests()
def run(**kw):
    llm = LLM("tiny-random", **kw)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs
for dtype in ("float32", "float16", "bfloat16"):
    ref = run(kv_backend="contiguous", max_num_seqs=1, dtype=dtype)
    for name, kw in {"triton": {}, "triton-no-graphs": dict(cuda_graphs=False), "triton-torch-prefill": "tp"}.items():
        if kw == "tp":
            llm = LLM("tiny-random", kv_backend="paged", dtype=dtype, kv_cache_memory=2**28)
            llm.backend.prefill_impl = "torch"
            got = [o.token_ids for o in llm.generate(prompts, params)]
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        else:
            got = run(kv_backend="paged", dtype=dtype, kv_cache_memory=2**28, **kw)
        print(dtype, name, "differs at", [i for i, (a, b) in enumerate(zip(got, ref)) if a != b], flush=True)
