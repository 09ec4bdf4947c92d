"""The answer must be the learner's own code: what the drills and bug labs refuse before they check.

minikv itself is importable wherever the checker runs, so a drill's `match_prefix` could be the
engine's own (`from minikv.cache.prefix.radix import match_prefix`) and a lab's fix could hand the
engine's own class back through the seam. Both would pass while teaching nothing. Refused here:

- an import of minikv (or `importlib.import_module`, `__import__`, `sys.modules`) that the shipped
  file did not have: the starter's own imports (a Node class, an error type) stay allowed;
- a function or class the exercise names that is not defined in the learner's file (an alias of
  the engine's, a lambda defined elsewhere);
- a seam value that is None, a string (the engine's built-in design), or code not defined in the file.

What it does not stop: code copied by hand from minikv's source into the file. That is reading the
engine, which the course allows; the drill's clock is the defence there.
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

DYNAMIC_IMPORTS = {"import_module", "__import__"}


def minikv_imports(path: Path) -> tuple[set[str], list[str]]:
    """(the minikv names the file imports, as 'module:name' or 'module'; other ways to reach modules)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    dynamic: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "minikv"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "minikv":
            names |= {f"{node.module}:{a.name}" for a in node.names}
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if called in DYNAMIC_IMPORTS:
                dynamic.append(f"line {node.lineno}: {called}(...)")
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            dynamic.append(f"line {node.lineno}: sys.modules")
    return names, dynamic


def foreign_imports(path: Path, shipped: Path) -> str | None:
    """Why the file reaches into minikv beyond what the shipped file imports (None: it does not)."""
    mine, dynamic = minikv_imports(path)
    allowed, allowed_dynamic = minikv_imports(shipped)
    extra = sorted(mine - allowed)
    if extra:
        return (f"{path.name} imports {', '.join(extra)} from minikv: the exercise asks for your own code, not the "
                f"engine's answer; remove the import (allowed: {', '.join(sorted(allowed)) or 'none'})")
    if len(dynamic) > len(allowed_dynamic):
        return (f"{path.name} loads modules at run time ({'; '.join(dynamic)}): write the code in the file instead "
                "of reaching the engine's")
    return None


def defined_here(obj: object, path: Path, module: ModuleType) -> bool:
    """Is this function, class, method or instance (of a class) defined in the file at `path`?"""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    code = getattr(obj, "__code__", None)
    if code is not None:
        return Path(code.co_filename).resolve() == path.resolve()
    if isinstance(obj, type):
        return obj.__module__ == module.__name__
    return type(obj).__module__ == module.__name__  # an instance of a class of the file


def shipped_names(shipped: Path, skip: tuple[str, ...] = ("engine_options",)) -> list[str]:
    """Functions and methods the shipped file defines: 'fn' or 'Class.method'."""
    tree = ast.parse(shipped.read_text())
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name not in skip:
            out.append(node.name)
        elif isinstance(node, ast.ClassDef):
            out += [f"{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)]
    return out


def missing_definitions(module: ModuleType, path: Path, names: list[str]) -> list[str]:
    """Of `names` ('fn' or 'Class.method'), those not defined in the learner's file."""
    missing = []
    for name in names:
        owner, _, attr = name.partition(".")
        obj = getattr(module, owner, None)
        if attr:
            obj = obj.__dict__.get(attr) if isinstance(obj, type) else None
        if obj is None or not defined_here(obj, path, module):
            missing.append(name)
    return missing
