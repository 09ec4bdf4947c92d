"""Run each course notebook top to bottom and record how long it takes.

    python scripts/notebook_times.py                       every notebook under notebooks/
    python scripts/notebook_times.py notebooks/05_*.ipynb  some of them
    python scripts/notebook_times.py --limit 150           fail (exit 1) if one runs longer
    python scripts/notebook_times.py --update notebooks/09_*.ipynb   re-time some, keep the others' record

Each notebook runs in a fresh kernel (nbconvert's ExecutePreprocessor, the kernel started in the
notebook's folder, as `jupyter nbconvert --execute` would), on a copy in memory: the files are never
written. For each notebook: the wall time from kernel start to the last cell, the kernel's CPU time,
and the slowest cell. The table goes to benchmarks/notebook_times.md and the raw figures to
benchmarks/notebook_times.json, with the machine they ran on and its load average: on a shared
machine a busy neighbour stretches every wall time, so the load is part of the record.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor

ROOT = Path(__file__).resolve().parent.parent


class TimedExecutePreprocessor(ExecutePreprocessor):
    """ExecutePreprocessor that keeps the wall time of each code cell."""

    def preprocess(self, nb, resources=None, km=None):
        self.cell_seconds: list[tuple[int, float]] = []
        return super().preprocess(nb, resources, km)

    def preprocess_cell(self, cell, resources, index):
        t0 = time.perf_counter()
        try:
            return super().preprocess_cell(cell, resources, index)
        finally:
            if cell.cell_type == "code":
                self.cell_seconds.append((index, time.perf_counter() - t0))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_GiB": round(mem_gib, 1) if mem_gib else None,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "commit": commit}


def first_line(cell) -> str:
    for line in cell.source.splitlines():
        if line.strip() and not line.startswith("# NBVAL"):
            return line.strip()[:70]
    return ""


def run_one(path: Path, timeout: int) -> dict:
    nb = nbformat.read(path, as_version=4)
    ep = TimedExecutePreprocessor(timeout=timeout, kernel_name="python3")
    load_before = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    error = None
    try:
        ep.preprocess(nb, {"metadata": {"path": str(path.parent)}})
    except CellExecutionError as e:
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
        error = lines[-1][:300] if lines else type(e).__name__
    except Exception as e:  # a timeout or a dead kernel: still record what ran
        error = f"{type(e).__name__}: {e}"[:300]
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cells = ep.cell_seconds
    slowest = max(cells, key=lambda c: c[1]) if cells else (None, 0.0)
    return {"notebook": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "seconds": round(wall, 1), "cells_seconds": round(sum(s for _, s in cells), 1),
            "kernel_cpu_seconds": round((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), 1),
            "slowest_cell": slowest[0], "slowest_cell_seconds": round(slowest[1], 1),
            "slowest_cell_source": first_line(nb.cells[slowest[0]]) if slowest[0] is not None else "",
            "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
            "code_cells": len(cells), "error": error,
            "cells": [{"cell": i, "seconds": round(t, 2), "source": first_line(nb.cells[i])} for i, t in cells]}


def cost(r: dict) -> float:
    """What the limit is held against: the kernel's CPU seconds. On an idle machine a notebook's wall time is
    about its CPU time; on a shared one the wall time also counts the waits for a core, which are not the
    notebook's doing (the load average beside each row says how busy the machine was)."""
    return r["kernel_cpu_seconds"]


def markdown(record: dict) -> str:
    m = record["machine"]
    lines = [
        "# Notebook run times",
        "",
        f"Recorded by `scripts/notebook_times.py` on {record['date']} (commit {m['commit']}): each notebook run top to",
        "bottom in a fresh kernel (nbconvert's ExecutePreprocessor), nothing skipped.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_GiB']} GiB, GPU: {m['gpu'] or 'none'};"
        f" Python {m['python']},"
        f" torch {m['torch']}; OMP_NUM_THREADS={m['OMP_NUM_THREADS'] or 'unset'}. Load average (1 min) at the start"
        " of each notebook is listed: the machine is shared, and other work on it stretches the wall times;"
        " the kernel's CPU time varies much less.",
        "",
        f"Limit: {record['limit_seconds']:.0f} s of kernel CPU time per notebook"
        " (about its wall time on an idle machine).",
        "",
        "| notebook | wall time | kernel CPU | slowest cell | its time | load avg | timed | result |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for r in record["notebooks"]:
        result = "error: " + r["error"] if r["error"] else ("over the limit" if cost(r) > record["limit_seconds"]
                                                             else "ok")
        src = r["slowest_cell_source"].replace("|", "\\|")
        lines.append(f"| {r['notebook']} | {r['seconds']:.0f} s | {r['kernel_cpu_seconds']:.0f} s | "
                     f"[{r['slowest_cell']}] `{src}` | {r['slowest_cell_seconds']:.0f} s | "
                     f"{r['load_average_before']:.1f} | {r.get('date', record['date'])} | {result} |")
    total = sum(r["seconds"] for r in record["notebooks"])
    lines += ["", f"Total: {total:.0f} s of wall time for {len(record['notebooks'])} notebooks.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    ap.add_argument("--limit", type=float, default=120.0,
                    help="kernel CPU seconds allowed per notebook (default 120: about 2 minutes on an idle machine)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell before it is stopped")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "notebook_times",
                    help="writes OUT.md and OUT.json (default benchmarks/notebook_times); '-' writes nothing")
    ap.add_argument("--update", action="store_true",
                    help="keep the record's other notebooks (each row keeps its own date and load); default: replace")
    args = ap.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
              "limit_seconds": args.limit, "notebooks": []}
    kept = []
    if args.update and args.out.with_suffix(".json").is_file():
        previous = json.loads(args.out.with_suffix(".json").read_text())
        kept = [r for r in previous["notebooks"] if (ROOT / r["notebook"]).resolve() not in paths
                and (ROOT / r["notebook"]).is_file()]
    for path in paths:
        r = run_one(path, args.timeout)
        r["date"] = record["date"]
        record["notebooks"].append(r)
        flag = "ERROR " + r["error"] if r["error"] else ("OVER LIMIT" if cost(r) > args.limit else "ok")
        print(f"{r['notebook']:<52} {r['seconds']:>6.1f} s (CPU {r['kernel_cpu_seconds']:>6.1f} s; slowest cell "
              f"[{r['slowest_cell']}] {r['slowest_cell_seconds']:.1f} s; load {r['load_average_before']:.1f})  {flag}",
              flush=True)
    record["notebooks"] = sorted(kept + record["notebooks"], key=lambda r: r["notebook"])
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(record))
        print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")
    bad = [r for r in record["notebooks"] if r["error"] or cost(r) > args.limit]
    if bad:
        print(f"{len(bad)} notebook(s) failed or ran over {args.limit:.0f} s: " + ", ".join(r["notebook"] for r in bad),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
