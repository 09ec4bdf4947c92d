"""The CPU's top-p draws in C (cpu_topp.c), compiled on first use and called through ctypes.

torch has no op that reads a row of logits once for its maximum, its sum of exp and the mass near its top,
so its top-p path on the CPU costs about two greedy steps (benchmarks/NOTES_sampler.md). The C file does
it in two passes over each row, vectorised by the compiler, and draws the same tokens as the sorted path
(sampler.py's `_sample_nucleus`), or says it is not sure of a row, which the sorted path then draws.

The library is built once per machine with the C compiler the environment names (CC, else cc, gcc or
clang), for this CPU (-march=native), into the build/ folder of the model cache (MINIKV_CACHE, else
~/.cache/minikv), named by a hash of the source, the flags and the CPU, so that a changed file or another
machine builds anew; once built, it loads without a compiler. Without one and no library built, or with
MINIKV_CPU_TOPP=torch, `library()` is None and the sampler keeps its torch path; `why_not()` says why.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_topp.c")
FLAGS = ["-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC"]
# tried in turn: a compiler without -march=native or without OpenMP (clang without libomp) builds with less.
# 512-bit vectors where the CPU has them: gcc's tuning for Intel's AVX-512 cores prefers 256 bits, and the
# pass over a row ran 1.2x faster with 512 on a Sapphire Rapids host (2026-11-29, benchmarks/NOTES_sampler.md)
CHOICES = (["-march=native", "-mprefer-vector-width=512", "-fopenmp"], ["-march=native", "-fopenmp"], ["-fopenmp"],
           ["-march=native"], [])
_state: dict = {}


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _build(cc: str, out: Path) -> None:
    """Compile into a temporary file beside `out`, then rename it: a library appears whole or not at all,
    however many processes build it at once."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for more in CHOICES:
            run = subprocess.run([cc, *FLAGS, *more, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
            if run.returncode == 0:
                os.replace(tmp, out)
                return
        raise RuntimeError(f"{cc} could not build {SOURCE.name}: {run.stderr.strip()[-500:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load():
    if os.environ.get("MINIKV_CPU_TOPP", "").lower() == "torch":
        return None, "MINIKV_CPU_TOPP=torch"
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((FLAGS, CHOICES)).encode(), _cpu_signature().encode()):
        digest.update(part)
    cache = Path(os.environ.get("MINIKV_CACHE") or Path.home() / ".cache" / "minikv").expanduser()
    path = cache / "build" / f"cpu_topp-{digest.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            cc = _compiler()
            if cc is None:
                return None, "no C compiler (set CC, or install gcc): the torch path samples"
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot build or load {path} ({e}); point MINIKV_CACHE at a folder you can write"
    except RuntimeError as e:
        return None, str(e)
    fn = lib.minikv_top_p_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64]
    return fn, None


def library():
    """The compiled `minikv_top_p_rows`, or None (see `why_not`). Built or loaded once per process."""
    if "fn" not in _state:
        _state["fn"], _state["why"] = _load()
    return _state["fn"]


def why_not() -> str | None:
    """Why `library()` is None, or None when it is not."""
    library()
    return _state["why"]


def top_p_rows(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor,
               top_p: torch.Tensor, slack: float, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws of logits[rows] (float32 [B, V], rows contiguous in memory) at each row's temperature, key and
    top_p. Returns (choice int64 [n], sure bool [n]): a row not sure is for the sorted path to draw.
    threads: workers (OpenMP's), torch's thread count unless given. The call releases the GIL while it runs (ctypes
    does)."""
    fn = library()
    if fn is None:
        raise RuntimeError(f"the C top-p path is not available: {why_not()}")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1 or logits.device.type != "cpu":
        raise ValueError("top_p_rows reads float32 CPU logits [rows, vocab] whose rows are contiguous; got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device} with strides {logits.stride()}")
    rows = rows.to(torch.int64).contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    key = key.to(torch.int64).contiguous()
    top_p = top_p.to(torch.float32).contiguous()
    n = rows.numel()
    if not temperature.numel() == key.numel() == top_p.numel() == n:
        raise ValueError(f"temperature, key and top_p take one per row: {n} rows, got {temperature.numel()}, "
                         f"{key.numel()} and {top_p.numel()}")
    if n and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise IndexError(f"rows must lie in [0, {logits.shape[0]}); got {rows.min()}..{rows.max()}")
    choice = torch.zeros(n, dtype=torch.int64)
    sure = torch.zeros(n, dtype=torch.uint8)
    status = fn(logits.data_ptr(), logits.stride(0), rows.data_ptr(), n, logits.shape[-1], temperature.data_ptr(),
                key.data_ptr(), top_p.data_ptr(), float(slack), choice.data_ptr(), sure.data_ptr(),
                threads if threads is not None else torch.get_num_threads())
    if status != 0:
        sure.zero_()
    return choice, sure.bool()
