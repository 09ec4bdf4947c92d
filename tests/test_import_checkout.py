"""A plain checkout imports the package: the repository root on PYTHONPATH, nothing installed.

kernels/ sits at the top of the repository. An install maps it to `minikv.kernels`; from a checkout
minikv/__init__.py does the same. Imported by its bare folder name (transformers probes for Hugging
Face's `kernels` package before it builds a model), the folder answers as an empty namespace.

Python runs here without its site module (-S): the site-packages directory is on PYTHONPATH, so
torch and transformers import, but .pth files are not run, so the editable install's finder (which
maps minikv to this checkout) never loads. What imports minikv is the checkout alone.
"""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]


def run_uninstalled(args: list[str], cwd: Path, pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath + SITE)), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


PROBE = f"""
import importlib.util, os, sys
from pathlib import Path
root = Path({str(ROOT)!r})
assert not any("editable" in repr(f).lower() for f in sys.meta_path), sys.meta_path

# transformers first, as a notebook may do: its probe for Hugging Face's `kernels` finds the folder
from transformers.utils.import_utils import is_kernels_available
assert is_kernels_available() is False
top = sys.modules.get("kernels")
assert top is None or (getattr(top, "__file__", None) is None and not hasattr(top, "paged_decode_attention")), top
assert "TRITON_INTERPRET" not in os.environ, "the probe ran minikv.kernels' set-up"

import minikv, minikv.kernels, minikv.kernels.decode_attention as dec
assert Path(minikv.__file__) == root / "minikv" / "__init__.py", minikv.__file__
assert Path(minikv.kernels.__file__) == root / "kernels" / "__init__.py", minikv.kernels.__file__
assert Path(dec.__file__) == root / "kernels" / "decode_attention.py", dec.__file__
assert minikv.kernels.paged_decode_attention is dec.paged_decode_attention

# and transformers still builds a model
from transformers import AutoModelForCausalLM, LlamaConfig
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
print("checkout ok")
"""


def test_a_checkout_on_pythonpath_imports_minikv_kernels_and_transformers_still_builds_models():
    # from a notebook kernel started in notebooks/ with the root on the path
    run = run_uninstalled(["-c", PROBE], cwd=ROOT / "notebooks", pythonpath=[str(ROOT)])
    assert run.returncode == 0 and "checkout ok" in run.stdout, run.stderr[-3000:]


@pytest.mark.slow  # a fresh interpreter runs a whole (small) benchmark
def test_pythonpath_dot_runs_the_throughput_benchmark_with_nothing_installed(tmp_path):
    """`PYTHONPATH=. python -m minikv.bench.throughput --small` from the root (two requests, minikv's
    engine only: the same code path, in a few seconds)."""
    out = tmp_path / "throughput.json"
    run = run_uninstalled(["-m", "minikv.bench.throughput", "--small", "--num-requests", "2",
                           "--sampling", "greedy", "--skip", "defaults,hf_cb,hf_padded", "--out", str(out)],
                          cwd=ROOT, pythonpath=["."])
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["errors"] == [], record["errors"]
    assert record["checks"][0]["token_match"] == 1.0, record["checks"]
    assert [r["engine"] for r in record["results"]] == ["minikv"] and record["results"][0]["complete"]
