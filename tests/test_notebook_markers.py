"""Every notebook passes nbval on any machine, not only on the one that recorded its outputs.

nbval compares the stored output of every code cell it is not told to ignore, and it is told only by
a marker comment that is the marker alone (`# NBVAL_IGNORE_OUTPUT`; text after it turns it off, and
the floats beneath are then compared digit for digit) or by a cell tag. This test reads every
notebook, exercise and solution as nbval does and fails on

- a marker nbval would not honour: text after it, a misspelling, a wrong case, an unknown tag;
- a stored output nbval compares that holds a float (after the repository's sanitize patterns): its
  last digits are this CPU's rounding or this run's speed. Assert the claim in the cell and mark the
  printout `# NBVAL_IGNORE_OUTPUT` instead. A cell whose floats are the same on every machine (arithmetic
  on integers: a model's shapes, byte and block counts, the calculators; constants and source text)
  carries the tag `exact-output` and stays compared. Never give that tag to a cell whose printed floats
  come from tensor math, sampling or the clock.
"""
from __future__ import annotations

import configparser
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p for folder in ("notebooks", "exercises", "solutions") for p in (ROOT / folder).glob("*.ipynb"))

# what nbval 0.11 honours (nbval/plugin.py: comment_markers, metadata_tags)
MARKERS = {"NBVAL_IGNORE_OUTPUT": "ignore", "PYTEST_VALIDATE_IGNORE_OUTPUT": "ignore",
           "NBVAL_CHECK_OUTPUT": "check", "NBVAL_RAISES_EXCEPTION": "raises", "NBVAL_SKIP": "skip"}
TAGS = {m.lower().replace("_", "-"): kind for m, kind in MARKERS.items()} | {"raises-exception": "raises"}
# a float as printed: 0.25, 1.2e-05, 3e+02 (a version string such as 2.13.0 counts too: it changes with
# the machine's packages); integers and counts are fine
EXACT = "exact-output"  # this cell's floats are the same digits on any machine (integer arithmetic, constants)
FLOAT = re.compile(r"(?<![\w.])\d+\.\d+(?:[eE][+-]?\d+)?|(?<![\w.])\d+[eE][+-]?\d+(?![\w])")


def sanitizers() -> list[tuple[re.Pattern, str]]:
    """tests/nbval_sanitize.cfg, applied as nbval applies it (every section: regex -> replace)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "tests" / "nbval_sanitize.cfg")
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def sanitized(text: str, patterns) -> str:
    """`text` as nbval compares it: every sanitize pattern applied in turn."""
    for regex, replace in patterns:
        text = regex.sub(replace, text)
    return text


def source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def markers(cell: dict) -> tuple[set[str], list[str]]:
    """(the kinds nbval will act on, the marker-like lines or tags it will not honour)."""
    kinds, wrong = set(), []
    for line in source(cell).splitlines():
        line = line.strip()
        if not line.startswith("#"):
            continue
        comment = line.lstrip("#").strip()
        if comment in MARKERS:
            kinds.add(MARKERS[comment])
        elif re.search(r"nbval|pytest_validate", comment, re.IGNORECASE):
            wrong.append(f"comment {line!r}")
    for tag in cell.get("metadata", {}).get("tags", []):
        if tag in TAGS:
            kinds.add(TAGS[tag])
        elif re.search(r"nbval|raises", tag, re.IGNORECASE):
            wrong.append(f"tag {tag!r}")
    return kinds, wrong


def compared_texts(cell: dict):
    """The output strings nbval compares for this cell (image data and widget ids it skips)."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            yield text(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    yield text(value)
        elif out.get("output_type") == "error":
            yield f"{out.get('ename', '')}: {out.get('evalue', '')}"


def problems(path: Path, patterns) -> list[str]:
    nb = json.loads(path.read_text())
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        kinds, wrong = markers(cell)
        found += [f"cell {index}: nbval ignores the {w}: a marker must be alone on its line "
                  f"({', '.join('# ' + m for m in MARKERS if m.startswith('NBVAL'))}; explanation on the next line)"
                  for w in wrong]
        unrun = "execution_count" in cell and cell["execution_count"] is None
        if cell.get("outputs") and unrun and "skip" not in kinds:
            found.append(f"cell {index}: stored outputs but no execution_count: nbval fails it ('Unrun reference cell "
                         f"has outputs'); give it the count it would have, run top to bottom")
        if kinds & {"ignore", "skip"} or EXACT in cell.get("metadata", {}).get("tags", []):
            continue
        for out in compared_texts(cell):
            out = sanitized(out, patterns)
            if floats := FLOAT.findall(out):
                found.append(f"cell {index}: nbval compares this output, which holds floats {floats[:4]} "
                             f"(rounding and speed differ between machines): assert the claim in the cell and "
                             f"mark the printout # NBVAL_IGNORE_OUTPUT")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.name}" for p in NOTEBOOKS])
def test_every_nbval_marker_is_honoured_and_no_compared_output_holds_a_float(path):
    found = problems(path, sanitizers())
    assert not found, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(found)


def test_the_checker_catches_a_marker_with_text_after_it_and_a_compared_float(tmp_path):
    cell = {"cell_type": "code", "metadata": {}, "source": "# NBVAL_IGNORE_OUTPUT (rounding differs)\nprint(x)",
            "outputs": [{"output_type": "stream", "name": "stdout", "text": "error 7.2e-06\n"}]}
    ok = {"cell_type": "code", "metadata": {}, "source": "# NBVAL_IGNORE_OUTPUT\n# rounding differs\nprint(x)",
          "outputs": [{"output_type": "stream", "name": "stdout", "text": "error 7.2e-06\n"}]}
    tagged = {"cell_type": "code", "metadata": {"tags": ["nbval-ignore-outputs"]}, "source": "1", "outputs": []}
    counts = {"cell_type": "code", "metadata": {}, "source": "1",
              "outputs": [{"output_type": "stream", "name": "stdout", "text": "3 blocks, 48 tokens, took 1.5 s\n"}]}
    exact = {"cell_type": "code", "metadata": {"tags": ["exact-output"]}, "source": "1",
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "8.44 MiB for 2 rows\n"}]}
    untagged = {**exact, "metadata": {}}
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [cell, ok, tagged, counts, exact, untagged]}))
    found = problems(nb, sanitizers())
    assert len(found) == 4, found
    assert "cell 0" in found[0] and "nbval ignores the comment" in found[0]
    assert "cell 0" in found[1] and "7.2e-06" in found[1]
    assert "cell 2" in found[2] and "nbval-ignore-outputs" in found[2]  # a misspelt tag; cell 3's time is sanitized
    assert "cell 5" in found[3] and "8.44" in found[3]  # the same output, untagged


def test_the_checker_catches_stored_outputs_without_an_execution_count(tmp_path):
    """nbval fails a cell that holds outputs but says it never ran, even under # NBVAL_IGNORE_OUTPUT (a cell
    pasted into a notebook with the outputs of another run, but not its count)."""
    out = [{"output_type": "stream", "name": "stdout", "text": "took 3 ms\n"}]
    unrun = {"cell_type": "code", "execution_count": None, "metadata": {}, "source": "# NBVAL_IGNORE_OUTPUT\n1",
             "outputs": out}
    ran = {**unrun, "execution_count": 4}
    empty = {**unrun, "outputs": []}
    nb = tmp_path / "x.ipynb"
    nb.write_text(json.dumps({"cells": [unrun, ran, empty]}))
    (found,) = problems(nb, sanitizers())
    assert found.startswith("cell 0: stored outputs but no execution_count")
