"""The course's exercises as the grader trusts them: built from exercises/, shipped inside the package.

    exercise(name)  ->  Entry: the exercise's cells in order, as the course wrote them

An entry holds every code cell of the course's exercise except the learner's code:

    setup      the course's imports and the objects its checks use (an LLM, prompts), run as written
    exercise   the stub's names (`slot_mapping`, `class MyAllocator` and its methods): at this place the
               grader takes the learner's objects of these names, never the cell's code
    check      the call of a checker and its points

The grader runs these, never the submitted notebook's own check or setup cells, so a check cell
replaced by `print`, a renamed notebook or a grader installed from a wheel (no checkout at hand) grade
the same. The entries live in minikv/classroom/course.json, written from exercises/ by
`minikv release --registry` (a test fails while it is out of date): a new exercise needs its notebook
and that command, nothing in the grader.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

from minikv.classroom.notebooks import NEVER_RUN, NotGradable, points_of, read_notebook, source_of, tags_of

COURSE_FILE = Path(__file__).resolve().with_name("course.json")

# Engine objects that are an exercise's answer under another name than the stub's (the grader also refuses
# any engine function named like the stub, and any engine class with every method of a stub class).
ENGINE_ANSWERS: dict[str, list[str]] = {
    "04b_block_allocator": ["minikv.cache.blocks.allocator:FreeListAllocator",
                            "minikv.cache.blocks.allocator:CachingAllocator"],
    "06b_radix_match": ["minikv.cache.prefix.radix:RadixCache"],
    "06c_radix_insert": ["minikv.cache.prefix.radix:RadixCache"],
    "06d_lru_eviction": ["minikv.cache.prefix.hash_chain:HashChainCache"],
    "07a_copy_on_write": ["minikv.cache.block_manager:BlockManager"],
    "10a_two_tier_store": ["minikv.cache.tiers.tiered:TieredStore", "minikv.checks.tiers:ReferenceTwoTierStore"],
}


@dataclass
class CourseCell:
    id: str
    role: str                  # setup | exercise | check
    source: str
    points: float = 0.0        # check cells
    names: dict[str, list[str]] = field(default_factory=dict)  # exercise cells: name -> a class's methods


@dataclass
class Entry:
    name: str                  # e.g. 04a_slot_mapping
    cells: list[CourseCell]
    env: dict[str, str] = field(default_factory=dict)  # set before anything runs (TRITON_INTERPRET)
    engine_answers: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[CourseCell]:
        return [c for c in self.cells if c.role == "check"]

    @property
    def max_points(self) -> float:
        return sum(c.points for c in self.checks)

    @property
    def answer_names(self) -> dict[str, list[str]]:
        return {n: m for c in self.cells if c.role == "exercise" for n, m in c.names.items()}

    def to_dict(self) -> dict:
        return {"env": self.env, "engine_answers": self.engine_answers, "cells": [
            {k: v for k, v in vars(c).items() if v or k in ("id", "role", "source")} for c in self.cells]}

    @classmethod
    def from_dict(cls, name: str, d: dict) -> Entry:
        return cls(name, [CourseCell(**c) for c in d["cells"]], dict(d.get("env", {})),
                   list(d.get("engine_answers", [])))


def stub_names(source: str) -> dict[str, list[str]]:
    """The names an exercise cell defines at its top level (a class with its public methods)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    names: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = []
        elif isinstance(node, ast.ClassDef):
            names[node.name] = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                and not f.name.startswith("_")]
        elif isinstance(node, ast.Assign):
            names.update({t.id: [] for t in node.targets if isinstance(t, ast.Name)})
    return names


def _env_of(source: str) -> dict[str, str]:
    """os.environ["X"] = "constant" lines of a setup cell: the grader sets them before Python imports anything."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    env = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
                and ast.unparse(node.targets[0].value) == "os.environ" and isinstance(node.value, ast.Constant)
                and isinstance(node.targets[0].slice, ast.Constant)):
            env[str(node.targets[0].slice.value)] = str(node.value.value)
    return env


def entry_of_notebook(path: Path, name: str | None = None) -> Entry:
    """The entry of a course notebook (the course's exercises/ copy, or a teacher's own)."""
    nb = read_notebook(path)
    cells, env = [], {}
    for i, c in enumerate(nb["cells"]):
        tags = tags_of(c)
        if c.get("cell_type") != "code" or tags & NEVER_RUN:
            continue
        src, cid = source_of(c), str(c.get("id") or f"cell-{i}")
        if "check" in tags:
            cells.append(CourseCell(cid, "check", src, points_of(c)))
        elif "exercise" in tags:
            cells.append(CourseCell(cid, "exercise", src, names=stub_names(src)))
        else:
            cells.append(CourseCell(cid, "setup", src))
            env.update(_env_of(src))
    entry = Entry(name or path.stem, cells, env, list(ENGINE_ANSWERS.get(name or path.stem, [])))
    if not entry.checks:
        raise NotGradable(f"{path} is not an exercise notebook: no code cell is tagged `check` "
                          "(an exercise's check cells run its checker)")
    return entry


def build(exercises_dir: Path) -> dict[str, dict]:
    """course.json's content for a folder of exercise notebooks."""
    return {p.stem: entry_of_notebook(p).to_dict() for p in sorted(exercises_dir.glob("*.ipynb"))}


def render(exercises_dir: Path) -> str:
    return json.dumps(build(exercises_dir), indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def course() -> dict[str, Entry]:
    """Every exercise the package knows, by name."""
    if not COURSE_FILE.is_file():
        return {}
    data = json.loads(COURSE_FILE.read_text(encoding="utf-8"))
    return {name: Entry.from_dict(name, d) for name, d in data.items()}


def identify(nb: dict, stem: str, entries: dict[str, Entry]) -> Entry | None:
    """Which course exercise a notebook is: by its name, else (renamed) by the cells it shares with one."""
    if stem in entries:
        return entries[stem]
    ids = {str(c.get("id")) for c in nb.get("cells", []) if isinstance(c, dict)}
    sources = {source_of(c).strip() for c in nb.get("cells", []) if isinstance(c, dict)}
    best, score = None, 0
    for e in entries.values():
        s = sum(c.id in ids for c in e.cells) + sum(c.role == "check" and c.source.strip() in sources for c in e.cells)
        if s > score:
            best, score = e, s
    return best
