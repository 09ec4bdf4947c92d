"""The GPU benchmark scripts run end to end on tiny shapes here, so they cannot rot between the
rare runs on a GPU: every method they time must produce the reference's result. The kernel research
scripts live beside their records in benchmarks/ (not in the package) and are loaded from there."""
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from minikv.bench import decode_attention

ROOT = Path(__file__).resolve().parents[1]


def research_script(name: str):
    """benchmarks/<name>.py, imported as a module."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


decode_variants = research_script("decode_variants")
decode_profile = research_script("decode_profile")


def test_decode_attention_benchmark_smoke(tmp_path, capsys):
    record = decode_attention.main(["--smoke", "--no-flex", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "decode_attention_gpu.json").read_text())
    assert saved["decode"] and saved["prefill"]
    assert all(r["ok"] for r in record["decode"]), [r["rel_err_vs_fp32"] for r in record["decode"]]
    assert all(r["ok"] for r in record["ragged_correctness"])
    assert "triton at" in capsys.readouterr().out


def test_decode_variants_smoke(tmp_path):
    from minikv.kernels import decode_attention as current  # stands in for an earlier version of the file

    record = decode_variants.main(["--smoke", "--splits", "--previous", current.__file__, "--out", str(tmp_path)])
    assert "previous" in record["variants"]
    assert json.loads((tmp_path / "decode_variants_gpu.json").read_text())["shapes"]
    for shape, row in record["shapes"].items():
        for name in ("sdpa_contiguous", "sdpa_tokens_major", *record["variants"]):
            assert row[name]["rel_err"] <= decode_variants.TOL, (shape, name, row[name])
            assert row[name]["us"] > 0
    for shape, m in record["merge"].items():
        assert m["rel_err_new"] <= decode_variants.TOL and m["rel_err_old"] <= decode_variants.TOL, (shape, m)
    for shape, grid in record["split_grid"].items():
        assert grid["best"] and all(g["rel_err"] <= decode_variants.TOL for g in grid["grid"]), (shape, grid)


def test_clock_refuses_an_unknown_flush():
    with pytest.raises(ValueError, match="flush must be"):
        decode_attention.Clock(torch.device("cpu"), 1, 0, flush="sometimes")


def test_decode_profile_counts_the_instructions_that_matter_and_needs_a_gpu():
    ptx = ("cp.async.cg.shared.global [%r1], [%rd2], 0x10, %r3;\ncp.async.wait_group 0;\n"
           "ld.global.v4.b32 {%r4, %r5, %r6, %r7}, [%rd8];\nmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
    counts = decode_profile.instruction_counts(ptx)
    assert counts["cp.async (async copy to shared)"] == 1 and counts["ld.global 16-byte"] == 1
    assert counts["mma.sync (tensor cores)"] == 1 and counts["wgmma"] == 0
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            decode_profile.main(["--out", "never-made"])


def test_research_scripts_run_from_a_checkout_with_nothing_installed(tmp_path):
    """`python benchmarks/decode_variants.py --help` from anywhere: the script finds minikv in its
    checkout. Python runs without site (-S), so the installed minikv (an editable finder) is not seen."""
    site = os.pathsep.join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    env = {**os.environ, "PYTHONPATH": site, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-S", str(ROOT / "benchmarks" / "decode_variants.py"), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--previous" in run.stdout
