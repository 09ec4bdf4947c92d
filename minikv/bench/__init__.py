"""The course's benchmarks: `minikv bench <name>` or `python -m minikv.bench.<name>`.

    cache_speedup     CPU, SmolLM2: no cache vs the contiguous KV cache vs transformers
    prefix_ttft       time to first token with prefix caching off, hash chain, radix tree
    tiers_ttft        time to first token of a chat whose history no longer fits: offload tiers off, CPU, disk
    throughput        the nano-vllm offline workload: minikv's engines vs transformers'
    decode_attention  GPU: the Triton paged decode kernel vs SDPA and the torch reference
    serve             online serving: Poisson load of streaming clients against `minikv serve`

Kernel research scripts (variants of the decode kernel, its launch-settings tuner, an Nsight Compute
profile) live beside their records under benchmarks/, not in the package.
"""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def environment(device="cpu", commit: str | None = None) -> dict:
    """Where a figure was measured: the device, library versions and minikv's commit.

    commit: given, else $MINIKV_COMMIT (a GPU box without .git), else git's HEAD, marked
    "+uncommitted" when minikv/ differs from it."""
    import torch

    versions = {}
    for lib in ("triton", "transformers"):
        try:
            versions[lib] = __import__(lib).__version__
        except ImportError:
            versions[lib] = None
    commit = commit or os.environ.get("MINIKV_COMMIT") or _git_commit()
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
        name, sms = f"CPU: {cpu or platform.processor() or platform.machine()}", None
    return {"device": name, "sms": sms, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, **versions, "cuda": torch.version.cuda, "python": platform.python_version(),
            "commit": commit}


def load_script(path: Path):
    """A script under benchmarks/ (beside its records, not in the package) as a module, loaded from its
    file: the scripts that measure with another's functions, and the tests that run them, load it so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmarks_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _git_commit() -> str | None:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD") or None
        if commit and git("status", "--porcelain", "--", "minikv"):
            commit += "+uncommitted"
        return commit
    except OSError:  # no git on this machine
        return None
