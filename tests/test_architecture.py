"""Who may import whom: the cache knows nothing of the engine, no module of minikv imports itself
back through others, and no module imports from a floor above its own.

The imports are read with `ast` from the source, not by importing, so a circle is found even when
Python would get away with it. Every import statement counts, wherever it sits:

    top of the file              the module needs the other at import time
    under `if TYPE_CHECKING:`    the module's types name the other: the design still depends on it
    inside a function            a lazy import is the usual way to hide a circle; it is still one

An edge goes to the module named (`from minikv.cache.blocks import allocator` -> minikv.cache.blocks.allocator,
`from minikv.cache.prefix.radix import Node` -> minikv.cache.prefix.radix), not to the packages above it that
Python runs first: every module imports its parents' `__init__`, so counting those would make a
circle of any package whose `__init__` re-exports its children.

The floors, from the ground up (a module imports its own floor or those below, never one above):

    1  cache, kernels                      KV memory and the Triton kernels that read and write it
    2  attention, model                    the backends and the decoder that calls them; model shapes
    3  engine, minikv (the package face)   requests, scheduler, runner, sampler, the LLM facade
    4  viz, serve, bench, checks           what looks at, serves, times or checks the engine
    5  interview, classroom, cli           the course's tools, and the command line over everything
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"minikv": REPO / "minikv"}


def module_files() -> dict[str, tuple[Path, bool]]:
    """Every module of minikv: name -> (file, is a package __init__)."""
    mods = {}
    for pkg, root in PACKAGES.items():
        for f in sorted(root.rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join([pkg] + (parts[:-1] if is_pkg else parts))] = (f, is_pkg)
    return mods


MODULES = module_files()


def imports_of(name: str) -> list[tuple[str, int]]:
    """(imported name, line) for every import statement in the module, resolved to an absolute name:
    the submodule when `from X import Y` names one, else X."""
    path, is_pkg = MODULES[name]
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from ..cache import y
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                out.append((f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target, node.lineno))
    return out


def import_graph() -> dict[str, set[str]]:
    """minikv module -> the minikv modules it imports."""
    return {m: {t for t, _ in imports_of(m) if t in MODULES and t != m} for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as a path [a, b, ..., a], or None if the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


FLOORS = [("cache", "kernels"), ("attention", "model"), ("engine", "minikv"), ("viz", "serve", "bench", "checks"),
          ("interview", "classroom", "cli")]
FLOOR_OF = {room: i + 1 for i, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    """minikv.cache.blocks.pool -> cache; minikv.cli -> cli; minikv (the package face) -> minikv."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_reader_sees_every_kind_of_import():
    """The reader itself: the kinds of import the two tests below rely on are found."""
    assert len(MODULES) > 40 and "minikv.kernels.decode_attention" in MODULES and "minikv.cache" in MODULES
    llm = {t for t, _ in imports_of("minikv.engine.core")}
    assert {"minikv.cache.block_manager", "minikv.engine.sequence"} <= llm
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_cache_never_imports_the_engine():
    """minikv/cache/ owns KV memory and knows no request type, scheduler or runner: what it needs of a
    request is the Protocol in minikv/cache/blocks/block_table.py, which the engine's Sequence satisfies."""
    bad = [f"{MODULES[m][0].relative_to(REPO)}:{line} imports {t}"
           for m in MODULES if m == "minikv.cache" or m.startswith("minikv.cache.")
           for t, line in imports_of(m) if t == "minikv.engine" or t.startswith("minikv.engine.")]
    assert not bad, ("the cache must not import the engine (TYPE_CHECKING and function-level imports count):\n  "
                     + "\n  ".join(bad) + "\nuse the request Protocol of minikv/cache/blocks/block_table.py instead")


def test_no_import_circle_among_minikv_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, ("import circle: " + " -> ".join(cycle) + "\nmove what both need into a module "
                           "neither imports from, or build the objects in a factory both sides import")


# ---- nothing outside the engine reaches into it ----------------------------------------------------
ENGINE_FLOORS = ("minikv.engine", "minikv.cache", "minikv.attention", "minikv.model", "minikv.kernels")
ENGINE_PARTS = {"scheduler", "backend", "runner", "block_manager"}  # read through `view` (minikv/engine/view.py)
THIRD_PARTY_PRIVATE = {
    "_attn_implementation": "transformers' model config names its attention implementation so",
    "_showtraceback": "IPython's shell prints a traceback with it (the checkers' short errors)",
    "_repr_mimebundle_": "IPython's display protocol",
    "_exit": "os._exit ends a graded notebook's process without running its exit hooks (minikv check)",
    "_reader": "a multiprocessing.Queue's pipe end, waited on with connection.wait (as concurrent.futures' "
               "process pool waits on its result queue)",
}


def reaches_in(name: str) -> list[str]:
    """Where a module reaches an engine's parts (`x.scheduler`, `x.backend.pool`, ...) or a private name
    of an object other than itself."""
    path, _ = MODULES[name]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value.func if isinstance(node.value, ast.Call) else node.value  # super()._x is its own
        own = isinstance(base, ast.Name) and base.id in ("self", "cls", "super")
        private = node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in THIRD_PARTY_PRIVATE
        if not own and (node.attr in ENGINE_PARTS or private):
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_nothing_outside_the_engine_reaches_its_parts_or_private_names():
    """Views, checkers, bug labs, benchmarks and the server read the engine through `llm.view` (and the
    public methods of LLM): the scheduler's queues, the block manager, the attention backend's pool and
    every private name stay free to change."""
    outside = [m for m in MODULES if not m.startswith(ENGINE_FLOORS)]
    assert len(outside) > 30
    found = [hit for m in outside for hit in reaches_in(m)]
    assert not found, ("reaching into the engine from outside it:\n  " + "\n  ".join(found)
                       + "\nread it through llm.view (minikv/engine/view.py), or add what is missing there")


def test_the_reach_rule_sees_a_reach_in(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(llm):\n    return llm.scheduler.running, llm.backend.pool, llm._requests, self._ok\n")
    monkeypatch.setitem(MODULES, "minikv.viz.bad", (bad, False))
    assert sorted(h.rsplit(": ", 1)[1] for h in reaches_in("minikv.viz.bad")) == [
        "llm._requests", "llm.backend", "llm.scheduler"]


def test_every_part_of_minikv_stands_on_a_declared_floor():
    rooms = {room_of(m) for m in MODULES}
    assert rooms == set(FLOOR_OF), (f"rooms without a floor: {sorted(rooms - set(FLOOR_OF))}; floors naming no "
                                    f"room: {sorted(set(FLOOR_OF) - rooms)}; place each in FLOORS")


def test_no_module_imports_from_a_floor_above_its_own():
    """A back arrow (the cache importing the engine, a view importing the interview tools) ties a lower
    floor to a higher one: the lower one can no longer be read, tested or reused without it."""
    bad = [f"{MODULES[m][0].relative_to(REPO)}:{line} (floor {FLOOR_OF[room_of(m)]}) imports {t} "
           f"(floor {FLOOR_OF[room_of(t)]})"
           for m in MODULES for t, line in imports_of(m)
           if t in MODULES and FLOOR_OF[room_of(t)] > FLOOR_OF[room_of(m)]]
    assert not bad, ("imports from a floor above:\n  " + "\n  ".join(bad) + "\nmove what both need down to the "
                     "lower floor (or up to the importer), or pass it in as an argument")
