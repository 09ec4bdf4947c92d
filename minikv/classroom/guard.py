"""What the grader's process checks around a learner's code: tampering and the engine's own answers.

    snapshot(modules)            the functions and classes of those modules, as objects
    changed(snap)                what was rebound since: ["minikv.checks.report.fail", "torch.allclose"]
    engine_use(obj, answers, forbidden)
                                 why `obj` (a learner's answer) is the engine's own code, or None

Both run in the notebook's process (minikv/classroom/runner.py), so code written against them can
fool them; what they catch is what ordinary code does: rebinding a checker's `fail`, patching
`torch.allclose`, handing in `minikv.cache.prefix.radix.match_prefix` or a one-line wrapper over it.
"""
from __future__ import annotations

import dis
import inspect
import sys
import types

WATCHED = ("builtins", "math", "operator", "os", "io", "json", "torch", "torch.nn.functional", "torch.testing",
           "hashlib", "collections", "heapq", "random")

# Code a teacher should read before trusting a grade: what reaches the grader, the process or other files.
SUSPECT = {"atexit": "an exit hook", "os.write": "writes to a file descriptor",
           "os.dup": "duplicates a file descriptor",
           "/proc/": "reads the process's own files", "sys.modules": "reaches into loaded modules",
           "ctypes": "ctypes", "gc.get_": "walks the garbage collector", "_getframe": "reads the call stack",
           "__code__": "swaps a function's code", "builtins": "changes builtins", "minikv.checks": "imports a checker",
           "solutions": "mentions solutions", "os._exit": "ends the process", "setattr(": "sets attributes by name",
           "importlib": "imports by name", "subprocess": "starts processes"}


def suspect(source: str) -> list[str]:
    """What in a learner's cell a teacher should read: ["atexit (an exit hook)", ...]."""
    return [f"{k} ({why})" for k, why in SUSPECT.items() if k in source]


def _watched_names(prefix_minikv: bool, skip_checks: bool) -> list[str]:
    names = [n for n in WATCHED if n in sys.modules]
    if prefix_minikv:
        names += sorted(n for n in list(sys.modules) if (n == "minikv" or n.startswith("minikv."))
                        and not (skip_checks and (n == "minikv.checks" or n.startswith("minikv.checks."))))
    return names


def _ident(v):
    return v, getattr(v, "__code__", None), getattr(v, "__defaults__", None)


def snapshot(skip_checks: bool = False) -> dict:
    """Every callable of the watched modules, and every class's own dict (a new key shadows a method)."""
    snap: dict = {"modules": {}, "attrs": {}, "classes": {}, "meta_path": list(sys.meta_path)}
    for name in _watched_names(True, skip_checks):
        mod = sys.modules.get(name)
        if not isinstance(mod, types.ModuleType):
            continue
        snap["modules"][name] = mod
        for k, v in list(vars(mod).items()):
            if not callable(v):
                continue
            snap["attrs"][(name, k)] = _ident(v)
            if isinstance(v, type) and (getattr(v, "__module__", None) == name or v is _tensor_class()):
                snap["classes"][(name, k)] = (v, {kk: vv for kk, vv in vars(v).items() if _method_like(vv)})
    return snap


def _tensor_class():
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


def _method_like(v) -> bool:
    return callable(v) or isinstance(v, (staticmethod, classmethod, property))


def changed(snap: dict) -> list[str]:
    """The watched names rebound, deleted or shadowed since `snap` (a module swapped in sys.modules too)."""
    out = []
    before, now = snap.get("meta_path", []), list(sys.meta_path)
    if any(f not in now for f in before) or (before and now and now[0] is not before[0]):
        out.append("sys.meta_path")  # an import hook ahead of Python's own could serve fake checkers
    for name, mod in snap["modules"].items():
        if sys.modules.get(name) is not mod and not name.startswith("minikv.checks"):
            out.append(f"sys.modules[{name!r}]")
    for (name, k), (obj, code, defaults) in snap["attrs"].items():
        now = vars(snap["modules"][name]).get(k)
        if now is not obj or getattr(now, "__code__", None) is not code or getattr(now, "__defaults__", None) \
                is not defaults:
            out.append(f"{name}.{k}")
    for (name, k), (cls, methods) in snap["classes"].items():
        now = {kk: vv for kk, vv in vars(cls).items() if _method_like(vv)}
        for kk in set(now) | set(methods):
            if now.get(kk) is not methods.get(kk) or getattr(now.get(kk), "__code__", None) is not getattr(
                    methods.get(kk), "__code__", None):
                out.append(f"{name}.{k}.{kk}")
    return sorted(set(out))


# ---- the engine's own answer ---------------------------------------------------------------------

def _from_minikv(obj) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__ == "minikv" or obj.__name__.startswith("minikv.")
    mod = getattr(obj, "__module__", None)
    return isinstance(mod, str) and (mod == "minikv" or mod.startswith("minikv."))


def _learners(obj) -> bool:
    """Defined in one of the learner's cells (code compiled from <cell N>)."""
    code = getattr(obj, "__code__", None)
    return code is not None and code.co_filename.startswith("<cell ")


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def forbidden_reason(obj, answers: dict[str, list[str]], listed: list[str], allowed: set[int]) -> str | None:
    """Why an engine object is this exercise's answer (None when it is a fair tool to use)."""
    if not _from_minikv(obj) or isinstance(obj, types.ModuleType):
        return None
    q = _qualname(obj)
    if q in listed or any(q.startswith(x + ".") for x in listed):
        return q
    name = getattr(obj, "__name__", None)
    if inspect.isclass(obj):
        if id(obj) in allowed or getattr(obj, "_is_protocol", False):  # the course's own tools, interfaces
            return None
        own = {k for k in dir(obj) if not k.startswith("_")}
        for methods in answers.values():
            if methods and set(methods) <= own:
                return q
        return None
    if name in answers:
        return q
    mod = getattr(obj, "__module__", "") or ""
    if (mod == "minikv.checks" or mod.startswith("minikv.checks.")) and callable(obj):
        return q  # a checker's reference or the checker itself
    return None


def _code_refs(code: types.CodeType, glb: dict):
    """The objects a code object reaches by global names and attribute chains (radix.match_prefix)."""
    chain = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = ins.argval
            chain = glb.get(name)
            if chain is not None:
                yield chain
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain = getattr(chain, ins.argval, None)
            if chain is not None:
                yield chain
        else:
            chain = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_refs(const, glb)


def _parts(obj):
    """Functions and values an answer is made of: itself, a class's methods and bases, closures, defaults."""
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            if base is not object:
                yield base
        for v in vars(obj).values():
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            elif isinstance(v, property):
                yield from (f for f in (v.fget, v.fset, v.fdel) if f is not None)
                continue
            yield v
        return
    for attr in ("func", "__wrapped__", "__func__"):  # functools.partial, functools.wraps, bound methods
        inner = getattr(obj, attr, None)
        if inner is not None and not isinstance(obj, type):
            yield inner
    for v in (getattr(obj, "__defaults__", None) or ()):
        yield v
    for v in (getattr(obj, "__kwdefaults__", None) or {}).values():
        yield v
    for cell in (getattr(obj, "__closure__", None) or ()):
        try:
            yield cell.cell_contents
        except ValueError:
            continue


def engine_use(obj, answers: dict[str, list[str]], listed: list[str], allowed: set[int]) -> str | None:
    """The engine object a learner's answer is, or wraps (its code reaches it), or None."""
    if _from_minikv(obj) and not isinstance(obj, types.ModuleType):
        return _qualname(obj)  # handed in as it is: `from minikv... import match_prefix`
    seen: set[int] = set()
    todo = [obj]
    while todo and len(seen) < 500:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        why = forbidden_reason(o, answers, listed, allowed)
        if why is not None:
            return why
        if _from_minikv(o):
            continue  # a fair tool of the engine: its own code is not the learner's
        todo.extend(_parts(o))
        code = getattr(o, "__code__", None)
        if code is None and hasattr(o, "fn"):  # a triton.jit kernel wraps the learner's function
            todo.append(o.fn)
        if isinstance(code, types.CodeType) and _learners(o):
            glb = getattr(o, "__globals__", {})
            for ref in _code_refs(code, glb):
                if _learners(ref) or isinstance(ref, type) or _from_minikv(ref) or callable(ref):
                    todo.append(ref)
    return None
