"""Interview preparation: the question bank, the timed drills, the find-the-bug labs and their commands.

Pinned here: every question has a model answer, a follow-up, a difficulty, a topic and a notebook
(and section) of the course that exists, or says it is beyond the course; the bank holds what the
instructor key answers, word for word; every drill's reference passes its checker and its starter
fails it, on random cases that change from run to run; every bug lab's buggy code fails its
scenario and its fixed code passes; `quiz`, `drill` and `bugs` have --help and the README describes
them.
"""
from __future__ import annotations

import importlib.util
import io
import json
import sys
import time
from pathlib import Path

import pytest

from minikv.cli import main
from minikv.interview import bank, bugs, drills, quiz

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = bank.load()

_spec = importlib.util.spec_from_file_location("instructor_questions", ROOT / "instructor" / "questions.py")
key = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("instructor_questions", key)
_spec.loader.exec_module(key)


# ---- the question bank -----------------------------------------------------------------------------

def test_bank_has_120_questions_each_with_answer_follow_up_difficulty_topic_and_an_existing_notebook():
    assert len(QUESTIONS) >= 120, f"the bank holds {len(QUESTIONS)} questions; the course promises at least 120"
    faults = bank.problems(QUESTIONS, ROOT)
    assert not faults, "the question bank:\n  " + "\n  ".join(faults)


def test_bank_validator_names_a_missing_notebook_heading_answer_and_follow_up():
    good = QUESTIONS[0]
    broken = [
        bank.Question("x1", good.question, good.answer, good.difficulty, good.topic, "notebooks/99_nothing.ipynb",
                      good.heading, good.follow_ups),
        bank.Question("x2", good.question, good.answer, good.difficulty, good.topic, good.notebook, "No such heading",
                      good.follow_ups),
        bank.Question("x3", good.question, "short", "easy", "weather", None, "somewhere", []),
    ]
    text = "\n".join(bank.problems(broken, ROOT))
    for fault in ("99_nothing.ipynb does not exist", "has no heading 'No such heading'", "an answer of 5 characters",
                  "difficulty 'easy'", "topic 'weather'", "no follow-up", "the heading must say"):
        assert fault in text, f"the validator did not report {fault!r}:\n{text}"


def test_bank_covers_the_topics_interviews_ask_beyond_the_course():
    beyond = [q for q in QUESTIONS if q.beyond_course]
    assert len(beyond) >= 15
    text = " ".join(q.question + " " + q.answer for q in QUESTIONS)
    for term in ("MLA", "tensor parallelism", "gpu_memory_utilization", "profiling run", "Little's law", "goodput",
                 "p99", "roofline", "speculative", "rejected", "fp8", "sliding window", "sink", "H2O", "SnapKV",
                 "disaggregation", "FlashAttention", "FlashInfer", "cascade", "chunked prefill", "num_tokens - 1"):
        assert term.lower() in text.lower(), f"no question covers {term!r}"
    for level in bank.DIFFICULTIES:
        assert sum(q.difficulty == level for q in QUESTIONS) >= 10, f"fewer than 10 {level} questions"


def test_bank_holds_the_instructor_keys_questions_and_answers_word_for_word():
    asked = key.all_questions(ROOT)
    by_source: dict[str, dict[str, str]] = {}
    for q in asked:
        by_source.setdefault(q.source, key.key_entries(q.key_file))
    imported = {q.notebook for q in QUESTIONS if not q.beyond_course and q.id.split("-q")[0] == Path(q.notebook).stem}
    stale, missing = [], []
    for q in QUESTIONS:
        if q.beyond_course or q.notebook not in by_source or not q.id.startswith(Path(q.notebook).stem + "-q"):
            continue
        if bank.unwrap(by_source[q.notebook].get(key.normalise(q.question)) or "") != q.answer:
            stale.append(q.id)
    bank_texts = {(q.notebook, key.normalise(q.question)) for q in QUESTIONS}
    for q in asked:
        if q.source in imported and (q.source, key.normalise(q.text)) not in bank_texts:
            missing.append(f"{q.source} Q{q.number}")
    fix = "run `python instructor/bank_import.py` (it keeps difficulty, topic and follow-ups)"
    assert not stale, f"the bank's copy differs from the instructor key for {stale}; {fix}"
    assert not missing, f"the course asks questions the bank lacks: {missing}; {fix}"
    assert len(imported) >= 20, f"only {len(imported)} notebooks and exercises imported into the bank"


def test_quiz_export_json_prints_every_question(capsys):
    assert main(["quiz", "--export", "json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert [e["id"] for e in exported] == [q.id for q in QUESTIONS]
    assert {"question", "answer", "follow_ups", "difficulty", "topic", "notebook", "heading"} <= set(exported[0])
    assert main(["quiz", "--export", "json", "--topic", "speculative-decoding", "--difficulty", "hard"]) == 0
    some = json.loads(capsys.readouterr().out)
    assert some and all(e["topic"] == "speculative-decoding" and e["difficulty"] == "hard" for e in some)


def test_quiz_reveals_on_a_key_press_keeps_the_score_and_asks_missed_questions_first(tmp_path):
    scores = tmp_path / "scores.json"
    picked = bank.select(QUESTIONS, topic="kv-size")[:3]
    out = io.StringIO()
    keys = "".join("\n" + "\n" * len(q.follow_up_answers) + grade + "\n" for q, grade in zip(picked, "yn")) + "\nq\n"
    tally = quiz.run(picked, io.StringIO(keys), out, scores=scores)
    assert tally == {"asked": 2, "got": 1, "partly": 0, "missed": 1}
    assert picked[0].answer.split()[0] in out.getvalue() and "Follow-ups:" in out.getvalue()
    data = json.loads(scores.read_text())
    assert data["questions"][picked[0].id]["got"] == 1 and data["questions"][picked[1].id]["missed"] == 1
    assert len(data["sessions"]) == 1
    again = quiz.order(picked, quiz.load_scores(scores), 3, seed=0)
    assert again[0].id == picked[1].id, "a question missed last time comes first"


def test_quiz_score_file_lives_under_minikv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    assert quiz.scores_file() == tmp_path / "quiz_scores.json"


# ---- timed drills ----------------------------------------------------------------------------------

def test_there_are_at_least_eight_drills_with_time_limits():
    assert len(drills.DRILLS) >= 8
    assert all(5 <= d.minutes <= 60 and d.statement for d in drills.DRILLS.values())


@pytest.mark.parametrize("name", list(drills.DRILLS))
def test_drill_reference_passes_and_starter_fails(name):
    drill = drills.DRILLS[name]
    ref = drills.run_check(drill, drill.reference, seed=20261126, timed=False)
    assert ref.passed, f"the reference of {name} fails its check:\n{ref.diagnosis}"
    starter = drills.run_check(drill, drill.starter, seed=20261126, timed=False)
    assert not starter.passed and "not written yet" in starter.diagnosis


def test_drill_checks_draw_new_random_cases_each_run_and_a_seed_replays_them():
    drill = drills.DRILLS["copy-on-write"]
    seeds = {drills.run_check(drill, drill.starter, timed=False).seed for _ in range(3)}
    assert len(seeds) == 3, "hidden cases: every check draws a fresh seed"


def test_drill_start_writes_the_starter_and_check_reports_time_against_the_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    assert main(["drill", "start", "slot-mapping-allocator"]) == 0
    out = capsys.readouterr().out
    assert "slot_mapping(block_table, positions, block_size)" in out and "15 min" in out
    assert (tmp_path / "drill_slot_mapping_allocator.py").read_text() == drills.DRILLS[
        "slot-mapping-allocator"].starter.read_text()
    assert main(["drill", "check", "slot-mapping-allocator"]) == 1
    assert "not written yet" in capsys.readouterr().out
    (tmp_path / "drill_slot_mapping_allocator.py").write_text(
        drills.DRILLS["slot-mapping-allocator"].reference.read_text())
    drills.start_clock("slot-mapping-allocator", now=drills.started("slot-mapping-allocator") - 20 * 60)
    assert main(["drill", "check", "slot-mapping-allocator", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["limit_minutes"] == 15 and result["seconds_taken"] >= 20 * 60
    assert main(["drill", "check", "slot-mapping-allocator"]) == 0
    assert "over the limit" in capsys.readouterr().out


def test_a_drill_check_that_never_returns_fails_with_a_time_limit_instead_of_hanging(tmp_path):
    stuck = tmp_path / "stuck.py"
    stuck.write_text("def causal_attention(q, k, v, scale=None):\n    while True:\n        pass\n")
    t0 = time.perf_counter()
    result = drills.run_check(drills.get("gqa-attention"), stuck, seed=1, timed=False, timeout=1.0)
    assert not result.passed and "did not finish in 1 s" in result.diagnosis, result.diagnosis
    assert time.perf_counter() - t0 < 30


def _drill_variant(tmp_path, name: str, old: str | None, new: str) -> Path:
    """A candidate's drill file: the reference with one edit (or with code appended)."""
    text = drills.DRILLS[name].reference.read_text()
    if old is None:
        text += new
    else:
        assert old in text, f"the fixture no longer matches the {name} reference: {old!r}"
        text = text.replace(old, new)
    path = tmp_path / drills.DRILLS[name].filename
    path.write_text(text)
    return path


_DICT_QUEUE = '''

class FreeBlockQueue:  # O(1) remove, but popleft walks over every slot deleted before the front
    def __init__(self):
        self.d = {}

    def append(self, b):
        self.d[b] = None

    def remove(self, b):
        del self.d[b]

    def popleft(self):
        if not self.d:
            raise IndexError("empty")
        b = next(iter(self.d))
        del self.d[b]
        return b

    def __len__(self):
        return len(self.d)

    def __contains__(self, b):
        return b in self.d

    def __iter__(self):
        return iter(list(self.d))
'''

# Each way to game a drill, as a fixture: (drill, old text of the reference, new text, what the diagnosis says).
GAMED_DRILLS = {
    "attention that ignores its scale": ("gqa-attention", None,
                                         "\n\n_inner = causal_attention\n\n\ndef causal_attention(q, k, v, scale):\n"
                                         "    return _inner(q, k, v, q.shape[-1] ** -0.5)\n", "use the `scale`"),
    "a decode step that ignores its scale": ("kv-decode-step", None,
                                             "\n\n_inner = decode_step\n\n\ndef decode_step(q, kn, vn, kc, vc, pos, "
                                             "scale):\n"
                                             "    return _inner(q, kn, vn, kc, vc, pos, q.shape[-1] ** -0.5)\n",
                                             "use the `scale`"),
    "the engine's match_prefix imported": ("radix-tree", None,
                                           "\n\nfrom minikv.cache.prefix.radix import match_prefix  # noqa\n",
                                           "imports minikv.cache.prefix.radix:match_prefix"),
    "the engine reached through sys.modules": ("radix-tree", None,
                                               "\n\nimport sys  # noqa\nmatch_prefix = sys.modules["
                                               "'minikv.cache.prefix.radix'].match_prefix\n", "sys.modules"),
    "evict_leaf skipping a used block": ("radix-tree",
                                         "    while leaf.blocks and len(taken) < num_blocks and "
                                         "is_unused(leaf.blocks[-1]):\n        taken.append(leaf.blocks.pop())\n"
                                         "        leaf.key = tuple(leaf.key[:-block_size])\n",
                                         "    for b in reversed(list(leaf.blocks)):\n"
                                         "        if len(taken) < num_blocks and is_unused(b):\n"
                                         "            taken.append(b)\n            leaf.blocks.remove(b)\n"
                                         "            leaf.key = tuple(leaf.key[:-block_size])\n",
                                         "would cut the edge in the middle"),
    "insert extending the root": ("radix-tree", "if node is not root and not node.children:",
                                  "if not node.children:", "the root is never extended"),
    "match_prefix scanning the children": ("radix-tree",
                                           "        child = node.children.get("
                                           "tuple(token_ids[pos:pos + block_size]))\n",
                                           "        child = next((c for f, c in node.children.items() if f == "
                                           "tuple(token_ids[pos:pos + block_size])), None)\n",
                                           "scanned a node's children"),
    "popleft by next(iter(dict))": ("lru-block-budget", None, _DICT_QUEUE, "popleft slows down"),
}


@pytest.mark.parametrize("gamed", list(GAMED_DRILLS))
def test_a_gamed_drill_answer_fails_with_the_reason(gamed, tmp_path):
    name, old, new, reason = GAMED_DRILLS[gamed]
    result = drills.run_check(drills.DRILLS[name], _drill_variant(tmp_path, name, old, new), seed=5, timed=False)
    assert not result.passed, f"{gamed}: passes the {name} drill"
    assert reason in result.diagnosis, f"{gamed}: the diagnosis does not say {reason!r}:\n{result.diagnosis}"


def test_drill_start_again_keeps_the_clock_restart_resets_it_and_status_shows_it(tmp_path, monkeypatch, capsys):
    from minikv.interview import clock

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    assert main(["drill", "status"]) == 0
    assert "no drill started yet" in capsys.readouterr().out
    assert main(["drill", "start", "copy-on-write"]) == 0
    assert "the clock starts now" in capsys.readouterr().out
    first = clock.get("copy-on-write")["started"]
    clock.start("copy-on-write", now=first - 300)  # five minutes in
    assert main(["drill", "start", "copy-on-write"]) == 0
    assert "keeps running" in capsys.readouterr().out and clock.get("copy-on-write")["started"] == first - 300
    assert main(["drill", "status"]) == 0
    out = capsys.readouterr().out
    assert "copy-on-write" in out and "min left" in out
    assert main(["drill", "start", "copy-on-write", "--restart"]) == 0
    assert "the clock starts now" in capsys.readouterr().out
    assert clock.get("copy-on-write")["started"] > first - 300


def test_a_clock_file_of_start_times_only_still_reads(tmp_path, monkeypatch):
    from minikv.interview import clock

    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    clock.clock_file().write_text(json.dumps({"radix-tree": 1000.0}))
    assert clock.get("radix-tree") == {"started": 1000.0, "attempts": 0, "passed_after": None}
    assert clock.record("radix-tree", passed=True, now=1600.0)["passed_after"] == 600.0
    assert "passed after 10.0 min and 1 check" in clock.describe(clock.get("radix-tree"), 45, "drill", "radix-tree")


def test_drill_list_json_and_the_shipped_files(capsys):
    assert main(["drill", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in listed] == list(drills.DRILLS)
    assert main(["drill", "check", "radix-tree", "--starter"]) == 1
    assert main(["drill", "check", "no-such-drill"]) == 2


# ---- find-the-bug labs -----------------------------------------------------------------------------

def test_there_are_at_least_eight_labs_each_through_a_named_seam():
    from minikv.engine.config import SEAMS

    seams = set(SEAMS) | {"block_allocator", "prefix_caching"}
    assert len(bugs.LABS) >= 8
    assert {lab.seam for lab in bugs.LABS.values()} <= seams
    assert len({lab.seam for lab in bugs.LABS.values()}) >= 5


@pytest.mark.parametrize("name", list(bugs.LABS))
def test_bug_lab_buggy_code_fails_its_check_and_fixed_code_passes(name):
    lab = bugs.LABS[name]
    buggy = bugs.run_check(lab, lab.buggy)
    assert not buggy.passed, f"{name}: the planted bug does not show:\n{buggy.diagnosis}"
    assert "scenario:" in buggy.diagnosis
    fixed = bugs.run_check(lab, lab.fixed)
    assert fixed.passed, f"{name}: the fixed code fails:\n{fixed.diagnosis}"


def test_a_lab_fix_that_unplugs_the_seam_does_not_count(tmp_path):
    lab = bugs.LABS["cow-decrement-first"]
    dodge = tmp_path / "bug_cow_decrement_first.py"
    dodge.write_text(lab.buggy.read_text() + "\n\ndef engine_options():\n    return {}\n")
    result = bugs.run_check(lab, dodge)
    assert not result.passed and "'copy_on_write' seam" in result.diagnosis


def _variant(tmp_path, lab: str, source: str, old: str | None = None, new: str = "") -> Path:
    """A learner's 'fix': the shipped file (buggy or fixed) with one edit, or with code appended."""
    text = getattr(bugs.LABS[lab], source).read_text()
    if old is not None:
        assert old in text, f"the fixture no longer matches {lab}'s {source} file: {old!r}"
        text = text.replace(old, new)
    else:
        text += new
    path = tmp_path / bugs.LABS[lab].filename
    path.write_text(text)
    return path


_OFF = ("\n\nclass _Off(TeamHashCache):\n    def match(self, token_ids, salt=None, max_tokens=None):\n"
        "        return type(super().match(token_ids[:0]))([], 0)\n\n\n"
        "def engine_options():\n    return {'prefix_caching': _Off(block_size=4)}\n")

# Each wrong fix a candidate might try, as a fixture: (lab, file it edits, old text, new text, what the
# diagnosis must say). None as old text appends the new text (a later engine_options() wins).
WRONG_FIXES = {
    "prefix caching off": ("stale-prefix-entry", "buggy", None,
                           "\n\ndef engine_options():\n    return {'prefix_caching': None}\n", "engine's own design"),
    "the engine's own cache": ("stale-prefix-entry", "buggy", None,
                               "\n\ndef engine_options():\n"
                               "    return {'prefix_caching': HashChainCache(block_size=4)}\n",
                               "not defined in"),
    "the built-in design by name": ("stale-prefix-entry", "buggy", None,
                                    "\n\ndef engine_options():\n    return {'prefix_caching': 'hash'}\n",
                                    "engine's own design"),
    "the override deleted": ("stale-prefix-entry", "fixed", "    def evict(self", "    def _old_evict(self",
                             "TeamHashCache.evict must stay defined"),
    "a cache that never hits": ("stale-prefix-entry", "fixed", None, _OFF, "where the engine's own cache"),
    "a bigger tile": ("missing-rescale", "buggy", "TILE = 8", "TILE = 32", "keep TILE = 8"),
    "one tile for the whole row": ("missing-rescale", "buggy", "TILE = 8", "TILE = 10**9", "keep TILE = 8"),
    "no running max": ("missing-rescale", "fixed", "m_new = torch.maximum(m, s.max(dim=1).values)",
                       "m_new = torch.zeros_like(m)", "inf or NaN"),
    "an import of the engine's code": ("missing-rescale", "fixed", None,
                                       "\n\nfrom minikv.cache.prefix.radix import match_prefix as _m  # noqa\n",
                                       "from minikv"),
    "copy-on-write off": ("cow-decrement-first", "buggy", None,
                          "\n\ndef engine_options():\n    return {'copy_on_write': None}\n", "engine's own design"),
    "copy every block, shared or not": ("cow-decrement-first", "fixed", "if ref_count[src] > 1:",
                                        "if ref_count[src] > 0:", "invariant check failed"),
}


@pytest.mark.parametrize("wrong", list(WRONG_FIXES))
def test_a_wrong_fix_is_rejected_with_the_reason(wrong, tmp_path):
    lab, source, old, new, reason = WRONG_FIXES[wrong]
    result = bugs.run_check(bugs.LABS[lab], _variant(tmp_path, lab, source, old, new), seed=7)
    assert not result.passed, f"{wrong}: accepted as a fix of {lab}:\n{result.report()}"
    assert reason in result.diagnosis, f"{wrong}: the diagnosis does not say {reason!r}:\n{result.diagnosis}"


def test_a_bigger_tile_still_fails_the_scenario_on_contexts_longer_than_the_tile(tmp_path):
    """Past the TILE rule: the scenario's contexts run longer than a 32-token tile."""
    import random

    from minikv.checks.report import CheckFailed

    module = drills.load_module(_variant(tmp_path, "missing-rescale", "buggy", "TILE = 8", "TILE = 32"), "bug_lab")
    with pytest.raises(CheckFailed, match="differs"):
        bugs.LABS["missing-rescale"].scenario(module, random.Random(11))


def test_the_stale_entry_lab_shows_the_wrong_answer_its_statement_reports():
    """The symptom as stated: a returning user's tokens differ (not an invariant or a crash first)."""
    lab = bugs.LABS["stale-prefix-entry"]
    for seed in (1, 2, 3):
        result = bugs.run_check(lab, lab.buggy, seed=seed)
        assert not result.passed and "at A a third time" in result.diagnosis, result.diagnosis
        assert "differs from the engine's own code" in result.diagnosis, result.diagnosis
    assert "block N is free; cannot share it" in lab.statement


def test_the_fixed_cache_never_crashes_on_a_returning_or_extended_prompt():
    """The crash a stale entry can cause ("block N is free") is the block manager refusing the lab's bad
    hit; with the fixed cache, returning and extended prompts never reach it."""
    import random

    lab = bugs.LABS["stale-prefix-entry"]
    honest = drills.load_module(lab.fixed, "bug_lab")
    for seed in range(4):
        lab.scenario(honest, random.Random(seed))


def test_a_lab_check_prints_its_seed_and_the_seed_replays_the_prompts():
    lab = bugs.LABS["slot-offset"]
    a, b = bugs.run_check(lab, lab.buggy, seed=42), bugs.run_check(lab, lab.buggy, seed=42)
    assert a.diagnosis == b.diagnosis and "--seed 42" in a.report()
    assert bugs.run_check(lab, lab.buggy).seed != bugs.run_check(lab, lab.buggy).seed


def test_fixed_prints_the_root_cause_the_regression_test_and_an_upstream_link():
    for name, lab in bugs.LABS.items():
        notes = lab.notes
        assert len(notes.hints) >= 2 and notes.cause and notes.regression and notes.field, name
        assert notes.links and all(u.startswith("https://") for u in notes.links), name
        assert "Localize it" not in lab.statement and f"minikv bugs hint {name}" in lab.statement, name
    lab = bugs.LABS["cow-decrement-first"]
    text = bugs.run_check(lab, lab.fixed, seed=1).report()
    for part in ("FIXED", "root cause:", "the regression test to add:", "seen in real engines:",
                 "https://github.com/vllm-project/vllm/pull/3347"):
        assert part in text, part


def test_bugs_start_hint_and_a_clock_that_stops_at_the_fix(tmp_path, monkeypatch, capsys):
    from minikv.interview import clock

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    assert main(["bugs", "start", "slot-offset"]) == 0
    out = capsys.readouterr().out
    assert "Stuck?" in out and "the clock starts now" in out
    assert main(["bugs", "hint", "slot-offset"]) == 0
    assert "hint 1 of 2" in capsys.readouterr().out
    assert main(["bugs", "hint", "slot-offset", "--level", "2"]) == 0
    assert "9 // 4" in capsys.readouterr().out
    assert main(["bugs", "check", "slot-offset"]) == 1
    assert "1 check so far" in capsys.readouterr().out
    (tmp_path / "bug_slot_offset.py").write_text(bugs.LABS["slot-offset"].fixed.read_text())
    assert main(["bugs", "check", "slot-offset"]) == 0
    assert "passed after" in capsys.readouterr().out
    entry = clock.get("bugs:slot-offset")
    assert entry["attempts"] == 2 and entry["passed_attempts"] == 2 and entry["passed_after"] is not None
    assert main(["bugs", "start", "slot-offset"]) == 0
    assert "keeps running" in capsys.readouterr().out
    assert clock.get("bugs:slot-offset")["started"] == entry["started"]
    assert main(["bugs", "status"]) == 0
    assert "slot-offset" in capsys.readouterr().out
    assert main(["bugs", "list", "--json"]) == 0
    assert {e["name"] for e in json.loads(capsys.readouterr().out)} == set(bugs.LABS)


# ---- commands and README ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["quiz"], ["drill"], ["drill", "check"], ["drill", "status"], ["bugs"],
                                  ["bugs", "check"], ["bugs", "hint"], ["mock"], ["progress"], ["design"]])
def test_interview_verbs_have_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--help"])
    assert exit_.value.code == 0
    assert "usage: minikv" in capsys.readouterr().out


def test_readme_describes_quiz_drill_and_bugs():
    readme = (ROOT / "README.md").read_text()
    for command in ("minikv quiz", "minikv drill start", "minikv drill check", "minikv bugs start",
                    "minikv bugs check", "12_design_worksheet.ipynb"):
        assert command in readme, f"README.md does not mention {command!r}"
    for command in ("minikv mock", "minikv progress", "minikv design", "minikv bugs hint", "minikv drill status",
                    "minikv quiz --due"):
        assert command in readme, f"README.md does not mention {command!r}"
    course = sum(q.notebook is not None and q.id.split("-q")[0] == Path(q.notebook).stem for q in QUESTIONS)
    assert f"holds {len(QUESTIONS)} questions: the {course} the notebooks" in readme, "README.md's bank figures"
    assert f"{len(drills.DRILLS)} timed drills" in readme and f"{len(bugs.LABS)} labs" in readme


def test_design_calculators_match_the_formulas():
    from minikv.interview.design import GPUS, MODELS, Deployment, littles_law

    d8 = Deployment(MODELS["Llama-3-70B"], GPUS["H100-SXM"], num_gpus=8, tp=8)
    assert d8.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2
    assert d8.kv_bytes_per_token == 327_680  # 320 KiB: the model's own
    d16 = Deployment(MODELS["Llama-3-70B"], GPUS["H100-SXM"], num_gpus=16, tp=16)
    assert d16.kv_heads_per_gpu == 1 and d16.kv_bytes_per_token == 2 * 327_680  # replicated past 8 KV heads
    assert 150 <= d8.max_sequences(8192) <= 180
    assert littles_law(50, 9.5) == 475
    with pytest.raises(ValueError, match="multiple of tp"):
        Deployment(MODELS["Llama-3-70B"], GPUS["H100-SXM"], num_gpus=12, tp=8)


def test_decode_step_is_bounded_by_its_bytes_and_by_its_flops():
    from minikv.interview.design import GPUS, MODELS, Deployment

    d = Deployment(MODELS["Llama-3-70B"], GPUS["H100-SXM"], num_gpus=8, tp=8)
    few, many = d.decode_step_seconds(8, 4096), d.decode_step_seconds(4096, 128)
    assert few == d.decode_step_bytes_seconds(8, 4096) > d.decode_step_compute_seconds(8, 4096)
    assert many == d.decode_step_compute_seconds(4096, 128) > d.decode_step_bytes_seconds(4096, 128)


def test_new_drill_checkers_name_the_classic_mistakes():
    import torch

    from minikv.checks.online_softmax import check_online_step
    from minikv.checks.report import CheckFailed
    from minikv.checks.speculative import check_num_accepted, check_rollback

    def no_rescale(q, k, v, m, l, acc, scale):
        s = q @ k.T * scale
        m_new = torch.maximum(m, s.max(dim=1).values)
        p = torch.exp(s - m_new[:, None])
        return m_new, l + p.sum(dim=1), acc + p @ v

    with pytest.raises(CheckFailed, match="raises the max"):
        check_online_step(no_rescale, num_random=0)

    def greedy_only(draft, p, q, u):  # compares argmaxes: wrong under sampling
        n = 0
        for i, t in enumerate(draft):
            if int(p[i].argmax()) != t:
                break
            n += 1
        return n

    with pytest.raises(CheckFailed, match="accepted"):
        check_num_accepted(greedy_only, num_random=50)

    def keep_everything(block_table, num_tokens, k, accepted, block_size, free):
        return num_tokens + accepted

    with pytest.raises(CheckFailed, match="freed"):
        check_rollback(keep_everything, num_random=0)


# ---- minikv quiz --notebook ------------------------------------------------------------------------

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_has_a_model_answer_for_each_question_it_asks(name):
    """Read from the notebook as it is now (a new appendix, a reworded or moved question included)."""
    from minikv.interview import asked

    found, _ = asked.asked(ROOT / "notebooks" / name, ROOT, QUESTIONS)
    assert found, f"notebooks/{name} asks no question the finder sees (a '## Questions ...' list at its end)"
    missing = [f"Q{a.number}: {a.text[:70]}" for a in found if a.entry is None]
    assert not missing, (f"notebooks/{name} asks questions the bank has no answer for: {missing}; answer each in "
                         f"instructor/notebooks/{Path(name).stem}.md, then run python instructor/bank_import.py")


def test_the_quiz_finds_the_questions_the_instructor_key_finds():
    from minikv.interview import asked

    for folder in ("notebooks", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            assert asked.questions_in(path) == [q.text for q in key.questions_in(path)], path.name


def test_quiz_notebook_prints_each_question_with_its_model_answer(capsys):
    from minikv.interview import asked

    assert main(["quiz", "--notebook", "06"]) == 0
    out = capsys.readouterr().out
    found, more = asked.asked(ROOT / "notebooks" / "06_prefix_caching.ipynb", ROOT, QUESTIONS)
    assert out.startswith(f"notebooks/06_prefix_caching.ipynb: {len(found)} questions")
    for a in found:
        assert _flat(a.text) in _flat(out), f"Q{a.number}"
        assert a.entry is None or _flat(a.entry.answer) in _flat(out), f"the answer to Q{a.number}"
    for q in more:
        assert _flat(q.question) in _flat(out) and _flat(q.answer) in _flat(out), q.id
    assert out.count("\nA:  ") == len(found) + len(more)
    assert "minikv quiz --notebook 06a" in out  # its exercises are named


def test_quiz_notebook_adds_the_banks_questions_tagged_with_the_notebook():
    from minikv.interview import asked

    _, more = asked.asked(ROOT / "notebooks" / "05_continuous_batching.ipynb", ROOT, QUESTIONS)
    assert "beyond-chunked-prefill-tradeoff" in {q.id for q in more}
    assert all(q.notebook == "notebooks/05_continuous_batching.ipynb" for q in more)


@pytest.mark.parametrize("same, as_", [("5", "05"), ("05_continuous_batching", "05"),
                                       ("notebooks/05_continuous_batching.ipynb", "05"),
                                       ("8b", "08b_triton_performance_appendix")])
def test_quiz_notebook_accepts_short_full_and_zero_less_ids(same, as_, capsys):
    assert main(["quiz", "--notebook", same]) == 0
    a = capsys.readouterr().out
    assert main(["quiz", "--notebook", as_]) == 0
    assert a == capsys.readouterr().out and a.startswith("notebooks/")


def test_quiz_notebook_names_an_exercise_where_no_notebook_takes_the_id(capsys):
    assert main(["quiz", "--notebook", "06a"]) == 0
    assert capsys.readouterr().out.startswith("exercises/06a_block_hash_chain.ipynb: ")
    assert main(["quiz", "--notebook", "08b"]) == 0  # the appendix notebook, not exercise 08b
    assert capsys.readouterr().out.startswith("notebooks/08b_triton_performance_appendix.ipynb: ")


def test_quiz_notebook_unknown_id_is_one_error_line_naming_the_valid_ids(capsys):
    assert main(["quiz", "--notebook", "99"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no notebook '99'")
    for valid in ("00b", "05", "08b", "12", "06a"):
        assert f" {valid}," in lines[0] or f" {valid};" in lines[0] or f" {valid} " in lines[0], valid


def test_quiz_notebook_reads_an_appendix_at_run_time_and_keeps_a_moved_questions_answer(tmp_path):
    """A question that moved from 05 into a new appendix keeps its answer; a new one says it has none."""
    from minikv.interview import asked

    moved = asked.questions_in(ROOT / "notebooks" / "05_continuous_batching.ipynb")[0]
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "exercises").mkdir()
    cell = {"cell_type": "markdown", "metadata": {}, "source": (
        "## Questions an interviewer might ask\n\n1. " + moved + "\n2. Why would a sampler run on its own\n"
        "   stream, and what must it wait for?\n")}
    (tmp_path / "notebooks" / "05b_sampler_and_async_appendix.ipynb").write_text(json.dumps({"cells": [cell]}))
    path = asked.resolve("5b", tmp_path)
    found, _ = asked.asked(path, tmp_path, QUESTIONS)
    assert [a.text for a in found] == [moved, "Why would a sampler run on its own stream, and what must it wait for?"]
    assert found[0].entry.notebook == "notebooks/05_continuous_batching.ipynb" and found[1].entry is None
    assert "no model answer in the bank yet" in asked.render(path, tmp_path, QUESTIONS)


def test_quiz_notebook_export_json_gives_each_question_and_its_entry(capsys):
    assert main(["quiz", "--notebook", "06", "--export", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["notebook"] == "notebooks/06_prefix_caching.ipynb"
    assert [q["number"] for q in data["questions"]] == list(range(1, len(data["questions"]) + 1))
    assert all(q["entry"] is None or q["entry"]["answer"] for q in data["questions"])


def test_quiz_notebook_in_a_student_copy_says_the_answers_are_held_back():
    from minikv.interview import asked

    beyond_only = [q for q in QUESTIONS if q.id.startswith("beyond-")]  # what a student copy's bank holds
    text = asked.render(ROOT / "notebooks" / "06_prefix_caching.ipynb", ROOT, beyond_only)
    assert "not part of a student copy" in text and "no model answer in the bank yet" not in text
    assert text.count("\nQ") >= len(asked.questions_in(ROOT / "notebooks" / "06_prefix_caching.ipynb"))
    student = [q for q in QUESTIONS if not (q.notebook or "").startswith("exercises/")]  # what a copy ships
    notebook = asked.render(ROOT / "notebooks" / "06_prefix_caching.ipynb", ROOT, student)
    exercise = asked.render(ROOT / "exercises" / "06a_block_hash_chain.ipynb", ROOT, student)
    assert "not part of a student copy" not in notebook and "A:  " in notebook
    assert "not part of a student copy" in exercise and "no model answer in the bank yet" not in exercise


def test_glossary_names_only_notebooks_and_sections_that_exist():
    """GLOSSARY.md says where each term is taught: every notebook it names exists, and every section number
    it gives is a numbered heading of that notebook."""
    import re

    text = (ROOT / "GLOSSARY.md").read_text()
    names = set(re.findall(r"`(\d\d[a-z]?_[a-z0-9_]+)`", text))
    assert len(names) >= 15
    for name in names:
        found = [ROOT / folder / f"{name}.ipynb" for folder in ("notebooks", "exercises")]
        assert any(p.is_file() for p in found), (f"GLOSSARY.md names {name}, which is neither in notebooks/"
                                                 " nor in exercises/")
    for name, sections in re.findall(r"`(\d\d[a-z]?_[a-z0-9_]+)` \(sections? ([0-9, and]+)\)", text):
        heads = {h.split(".")[0] for h in bank.notebook_headings(ROOT / "notebooks" / f"{name}.ipynb")}
        for n in re.findall(r"\d+", sections):
            assert n in heads, f"GLOSSARY.md points to section {n} of {name}, which has no such heading"


def test_every_notebook_that_points_to_its_quiz_names_itself():
    """A closing line `minikv quiz --notebook ID` must print the questions of the notebook that holds it."""
    import re

    from minikv.interview import asked

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for name in set(re.findall(r"minikv quiz --notebook ([A-Za-z0-9_]+)", path.read_text())):
            assert asked.resolve(name, ROOT) == path, f"{path.name} points to minikv quiz --notebook {name}"


# ---- the bank an interviewer would recognise ---------------------------------------------------------

def test_the_bank_covers_each_interview_area_with_at_least_15_questions():
    from collections import Counter

    counts = Counter(q.topic for q in QUESTIONS)
    for topic in ("speculative-decoding", "parallelism", "quantization", "serving-metrics", "system-design"):
        assert counts[topic] >= 15, f"{topic}: {counts[topic]} questions, the bank promises at least 15"
    assert len(QUESTIONS) >= 300, f"the bank holds {len(QUESTIONS)} questions; it promises at least 300"
    assert counts["moe"] >= 5 and counts["production"] >= 5


def test_interview_questions_answer_every_follow_up_and_link_the_engines_they_describe():
    import re

    added = [q for q in QUESTIONS if q.id.startswith("iv-")]
    assert len(added) >= 85
    answered = [q for q in QUESTIONS if q.follow_ups]  # every question of the bank, the exercises' included
    for q in answered:
        assert len(q.follow_up_answers) == len(q.follow_ups) >= 1, f"{q.id}: a follow-up without its answer"
        for text in [q.answer, *q.follow_up_answers]:
            if re.search(r"\bvLLM\b|\bSGLang\b", text):
                assert "github.com/" in text, f"{q.id}: describes vLLM or SGLang without a link to the source"
    for q in QUESTIONS:  # self-contained: no answer leans on a run the reader has not seen
        assert not re.search(r"[Nn]otebook \d\d\w?'s run", q.answer), q.id


def _figure(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def test_every_number_the_bank_takes_from_the_design_calculators_is_what_they_compute():
    """Each figure below is quoted in an answer; recompute it with minikv.interview.design and find it there."""
    from minikv.interview.design import GPUS, MODELS, Deployment, littles_law
    from minikv.model.shapes import ModelShape

    by_id = {q.id: " ".join([q.answer, *q.follow_up_answers]) for q in QUESTIONS}
    h100, h200, llama70 = GPUS["H100-SXM"], GPUS["H200"], MODELS["Llama-3-70B"]
    tp8, tp4 = Deployment(llama70, h100, 8, 8), Deployment(llama70, h100, 8, 4)
    fp8 = Deployment(llama70, h100, 8, 8, weight_bytes=1, kv_bytes=1)
    on_h200 = Deployment(llama70, h200, 8, 8)
    llama8 = Deployment(ModelShape("Llama-3.1-8B", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                   num_params=8.03e9, max_context=131072), h100)
    expected = {
        "iv-tp-degree": [_figure(tp8.pool_tokens_per_replica), _figure(tp4.pool_tokens_per_replica),
                         _figure(tp4.pool_tokens_per_replica * tp4.replicas), _figure(tp8.kv_bytes_per_token_per_gpu),
                         _figure(tp4.kv_bytes_per_token_per_gpu), f"{tp8.weights_per_gpu / 1e9:.1f} GB",
                         f"{tp8.pool_bytes_per_gpu / 2**30:.1f} GiB", f"{tp4.pool_bytes_per_gpu / 2**30:.1f} GiB",
                         _figure(Deployment(llama70, h100, 16, 16).kv_bytes_per_token)],
        "iv-design-offline-batch": [str(llama8.max_sequences(2200)),
                                    f"{llama8.decode_step_seconds(196, 2100) * 1e3:.1f} ms",
                                    f"{round(llama8.prefill_flops(2000) * 1e7 / (0.5 * h100.bf16_flops) / 3600)} "
                                    "GPU-hours"],
        "iv-quant-memory": [str(tp8.max_sequences(8192)), str(fp8.max_sequences(8192))],
        "iv-design-hardware": [f"{on_h200.pool_tokens_per_replica / 1e6:.2f}M", str(on_h200.max_sequences(8192)),
                               f"{on_h200.decode_step_seconds(64, 8192) * 1e3:.1f} ms",
                               f"{tp8.decode_step_seconds(64, 8192) * 1e3:.1f} ms"],
        "iv-design-cost-per-token": [f"{tp8.decode_step_seconds(256, 2048) * 1e3:.1f} ms",
                                     _figure(round(256 / tp8.decode_step_seconds(256, 2048), -2))],
        "iv-design-pd-sizing": [f"{tp8.decode_step_seconds(200, 4500) * 1e3:.1f} ms",
                                f"{tp8.decode_step_seconds(134, 4500) * 1e3:.1f} ms",
                                f"about {round(tp8.prefill_seconds(4096) * 1e3, -1):.0f} ms",
                                f"{tp8.prefill_flops(4096) / 1e15:.1f}e15", str(tp8.pool_tokens_per_replica // 4500),
                                f"{tp8.kv_transfer_seconds(4000, 8 * 50e9) * 1e3:.0f} ms"],
        "iv-mfu": [f"{tp8.prefill_flops(8192) / 1e15:.3f}e15",
                   f"{tp8.prefill_flops(8192) / (8 * h100.bf16_flops) * 1e3:.0f} ms"],
        "iv-mbu": [f"{tp8.weights_per_gpu / 1e9:.2f} GB"],
        "iv-mla-kv": [_figure(Deployment(llama70, h100).kv_bytes_per_token)],
        "beyond-kv-size-formula": [_figure(Deployment(llama70, h100).kv_bytes_per_token)],
        "00_tour-q1": [_figure(Deployment(MODELS["Llama-2-7B"], h100).kv_bytes_per_token)],
        "beyond-disaggregation": [f"about {tp8.kv_transfer_seconds(8192, 50e9) * 1e3:.0f} ms",
                                  f"about {tp8.kv_transfer_seconds(8192, 8 * 50e9) * 1e3:.0f} ms"],
        "12_design_worksheet-q5": [f"{round(littles_law(50, 0.5 + 299 * 0.030), -1):.0f}", "3,300"],
    }
    for qid, figures in expected.items():
        for figure in figures:
            assert figure in by_id[qid], f"{qid}: the calculators give {figure!r}, which the answer does not say"


def test_the_bank_ships_whole_in_a_student_copy_but_the_exercise_answers():
    from fnmatch import fnmatch

    from minikv.classroom.release import HELD_BACK

    shipped = [f"minikv/interview/data/{name}" for name in bank.FILES]
    held = [f for f in shipped if any(fnmatch(f, pattern) for pattern in HELD_BACK)]
    assert held == ["minikv/interview/data/course.json"], held
    course = [q for q in QUESTIONS if q.notebook and q.notebook.startswith("exercises/")]
    in_student_copy = bank.load()  # every file but course.json
    assert len(in_student_copy) - len(course) >= 195
    assert {q.topic for q in QUESTIONS if q.notebook is None or q.notebook.startswith("notebooks/")} >= {
        "system-design", "quantization", "speculative-decoding"}


def test_answers_are_stored_one_line_per_paragraph():
    import re

    wrapped = "first-\ncached blocks\nare reused\n\n- one\n- two"
    assert bank.unwrap(wrapped) == "first-cached blocks are reused\n\n- one\n- two"
    assert not [q.id for q in QUESTIONS if re.search(r"[a-z]- [a-z]", q.answer)], "a word cut at a line's end"


# ---- the quiz -------------------------------------------------------------------------------------------

def test_quiz_seed_reproduces_whatever_the_score_file_holds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["quiz", "--seed", "7", "-n", "3"]) == 0
    first = capsys.readouterr().out
    data = quiz.load_scores()
    for q in QUESTIONS[:50]:
        quiz.record(data, q.id, "n")
    quiz.save_scores(data)
    assert main(["quiz", "--seed", "7", "-n", "3"]) == 0
    again = capsys.readouterr().out
    assert first == again and "[1/3] " in first
    shown = first.split("[1/3] ")[1].split(" · ")[0]
    assert shown in {q.id for q in QUESTIONS}, "the question id is on screen"


def test_quiz_filters_by_id_grep_missed_and_says_when_fewer_match(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["quiz", "--id", "iv-mbu", "--export", "json"]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["iv-mbu"]
    assert main(["quiz", "--id", "iv-mbuu"]) == 2
    assert "did you mean iv-mbu" in capsys.readouterr().err
    assert main(["quiz", "--grep", "EAGLE", "--export", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and all("eagle" in (e["question"] + e["answer"] + " ".join(e["follow_ups"])).lower() for e in found)
    data = quiz.load_scores()
    quiz.record(data, "iv-mbu", "n")
    quiz.record(data, "iv-mfu", "y")
    quiz.save_scores(data)
    assert main(["quiz", "--missed", "--export", "json"]) == 0
    assert [e["id"] for e in json.loads(capsys.readouterr().out)] == ["iv-mbu"]
    moe = sum(q.topic == "moe" for q in QUESTIONS)
    assert main(["quiz", "--topic", "moe", "-n", "50"]) == 0
    assert f"only {moe} questions match; asking all of them" in capsys.readouterr().out


def test_quiz_topic_aliases_and_did_you_mean(capsys):
    assert main(["quiz", "--topic", "tp", "--export", "json"]) == 0
    assert {e["topic"] for e in json.loads(capsys.readouterr().out)} == {"parallelism"}
    assert main(["quiz", "--topic", "speculativ"]) == 2
    assert "did you mean 'speculative-decoding'" in capsys.readouterr().err


def test_spaced_repetition_schedules_like_sm2_and_due_asks_what_is_due():
    data = {"questions": {}, "sessions": []}
    day = 20_000
    quiz.record(data, "iv-mbu", "y", day)
    assert data["questions"]["iv-mbu"]["due"] == day + 1
    quiz.record(data, "iv-mbu", "y", day + 1)
    assert data["questions"]["iv-mbu"]["due"] == day + 7  # the second interval is 6 days
    quiz.record(data, "iv-mbu", "y", day + 7)
    entry = data["questions"]["iv-mbu"]
    assert entry["interval"] == round(6 * entry["ease"]) or entry["interval"] > 6
    quiz.record(data, "iv-mfu", "n", day)
    assert data["questions"]["iv-mfu"]["interval"] == 1 and data["questions"]["iv-mfu"]["ease"] < 2.5
    due = quiz.due(QUESTIONS, data, day + 1)
    assert [q.id for q in due] == ["iv-mfu"]
    assert {q.id for q in quiz.due(QUESTIONS, data, day + 400)} == {"iv-mbu", "iv-mfu"}


def test_quiz_exports_markdown_and_anki_cards(capsys):
    assert main(["quiz", "--topic", "moe", "--export", "md"]) == 0
    md = capsys.readouterr().out
    moe = sum(q.topic == "moe" for q in QUESTIONS)
    assert md.startswith(f"# minikv interview questions ({moe})") and "**Follow-up:**" in md and "`iv-mla-kv`" in md
    assert main(["quiz", "--topic", "moe", "--export", "anki"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r and not r.startswith("#")]
    assert len(rows) == moe and all(len(r.split("\t")) == 3 for r in rows)


def test_quiz_shows_a_follow_ups_answer_only_after_a_key_press(tmp_path):
    q = next(q for q in QUESTIONS if q.id == "iv-mbu")
    out = io.StringIO()
    quiz.run([q], io.StringIO("\n\ny\n"), out, scores=tmp_path / "s.json")
    text = out.getvalue()
    assert text.index("(Enter: its answer)") < text.index(q.follow_up_answers[0].split()[0] + " " +
                                                          q.follow_up_answers[0].split()[1])


# ---- mock interview, progress, design calculators on the command line ------------------------------------

def test_a_scripted_mock_interview_writes_its_report_under_minikv_home(tmp_path, monkeypatch, capsys):
    from minikv.interview import mock

    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    out, rubric = io.StringIO(), iter("ypnyy")

    def key(_stdin):  # the candidate: reveals everything, grades every answer y, scores the rubric y p n y y
        last = out.getvalue().rstrip().splitlines()[-1].strip()
        return "y" if last == "y / p / n" else next(rubric) if last.startswith("- ") and last.endswith("?") else "\n"

    path = mock.run(30, "ml-systems", io.StringIO(), out, seed=3, key=key)
    assert path.parent == tmp_path / "mocks" and str(path) in out.getvalue()
    text = path.read_text()
    for part in ("## Rapid-fire", "## Drill", "## Design", "design rubric: 7 / 10"):
        assert part in text, part
    picked = [line.split("`")[1] for line in text.splitlines() if line.startswith("- `")]
    assert len(picked) == 3 and set(picked) <= {q.id for q in QUESTIONS}
    assert main(["progress"]) == 0
    shown = capsys.readouterr().out
    assert "mock interviews: 1" in shown and "drills" in shown and "bug labs" in shown
    assert main(["mock", "--minutes", "5"]) == 2


def test_a_mock_hides_each_follow_ups_answer_until_the_candidate_answers(tmp_path, monkeypatch):
    from minikv.interview import mock

    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    out = io.StringIO()
    mock.run(30, "inference-engineer", io.StringIO("\ny\n" + "q\n"), out, seed=1)
    text = out.getvalue()
    assert text.count("A: ") == 1 and "Follow-up: " in text, "one answer revealed, the follow-up asked, not answered"


def test_minikv_design_prints_the_calculators_for_each_tp_degree(capsys):
    assert main(["design", "--tp", "8", "4"]) == 0
    out = capsys.readouterr().out
    assert "pool of all replicas: 1,351,670 tokens" in out and "pool of all replicas: 920,762 tokens" in out
    assert main(["design", "--tp", "3"]) == 2 and "multiple of tp" in capsys.readouterr().err


def test_a_quiz_asks_at_most_one_question_of_a_group_of_near_duplicates(tmp_path):
    groups = bank.duplicate_groups()
    ids = {q.id for q in QUESTIONS}
    assert len(groups) >= 10 and all(len(g) >= 2 and set(g) <= ids for g in groups)
    in_groups = [q for q in QUESTIONS if any(q.id in g for g in groups)]
    for seed in range(5):
        drawn = {q.id for q in quiz.order(in_groups, {"questions": {}, "sessions": []}, len(in_groups), seed)}
        assert all(len(drawn & set(g)) == 1 for g in groups), seed


def test_the_quiz_path_imports_no_torch():
    """`minikv quiz` needs only the bank: its modules import no torch, so the quiz can start in well under a
    second. (The package's own __init__ imports torch only where a CUDA device may exist, to set Triton's
    interpreter switch; this test loads the package without it, to pin what the quiz itself imports.)"""
    import subprocess

    code = ("import sys, types, io, contextlib\n"
            f"m = types.ModuleType('minikv'); m.__path__ = [{str(ROOT / 'minikv')!r}]; sys.modules['minikv'] = m\n"
            "from minikv.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['quiz', '--export', 'json', '--topic', 'moe']) == 0\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('minikv.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.strip()
    assert "'torch'" not in loaded and "minikv.checks" not in loaded, loaded


def test_importing_minikv_on_a_machine_without_cuda_loads_no_torch_and_switches_the_interpreter_on():
    """The package's __init__ decides Triton's interpreter switch without torch where no CUDA device can
    exist, and loads the engine's names on first use: `minikv quiz` then starts at once."""
    import subprocess

    import minikv

    if minikv._cuda_may_be_here():
        pytest.skip("a CUDA driver is present: torch decides the interpreter switch here, as it should")
    code = ("import os, sys\nos.environ.pop('TRITON_INTERPRET', None)\nimport minikv\n"
            "print('torch' in sys.modules, os.environ.get('TRITON_INTERPRET'))\n"
            "from minikv import LLM\nprint(LLM.__name__, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "1", "LLM", "True"], out.stdout


# Pairs whose question texts overlap but ask different things, on purpose. Each says why.
RELATED = {
    ("12_design_worksheet-q3", "iv-allreduce-cost"): "a decode step's memory bytes, against its all-reduce traffic",
    ("beyond-step-time-estimate", "iv-allreduce-cost"): "a decode step's memory bytes, against its all-reduce traffic",
    ("14a_shard_heads-q2", "iv-tp-degree"): "what each GPU holds at TP 8 and TP 16, against choosing one TP-8 "
                                            "replica or two TP-4 ones by the pool each leaves",
    ("iv-mbu", "iv-mfu"): "bandwidth utilisation of a decode step, against FLOPs utilisation of a prefill",
    ("beyond-kv-size-formula", "iv-mla-kv"): "the GQA formula, against MLA's latent (which the formula does not cover)",
    ("beyond-sliding-window-sinks", "iv-sliding-window-serving"): "attention sinks for streaming, against a "
                                                                  "hybrid model's two kinds of layers in one pool",
}
_STOP = set("the a an of to and in is it its what why how does do did for on with that this which you your be are "
            "as by or at from when would one each not no if than then there their them they can could should must "
            "will so but into only all any more most".split())


def _content_words(text: str) -> list[str]:
    """The question's words without the ones every question shares, plurals folded: 'K/V heads' = 'KV head'."""
    import re

    out = []
    for w in re.findall(r"[a-z0-9]+", text.lower().replace("k/v", "kv")):
        if w in _STOP:
            continue
        out.append(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


def near_duplicates(questions, threshold: float = 0.45) -> list[tuple[float, str, str]]:
    """(overlap, id, id) for each pair whose question texts overlap at `threshold` or more: the larger of the
    Jaccard index of their content words and difflib's ratio over the word sequences (word order counts)."""
    import difflib
    import itertools

    words = {q.id: _content_words(q.question) for q in questions}
    found = []
    for a, b in itertools.combinations(questions, 2):
        wa, wb = words[a.id], words[b.id]
        jaccard = len(set(wa) & set(wb)) / len(set(wa) | set(wb))
        score = max(jaccard, difflib.SequenceMatcher(None, wa, wb).ratio())
        if score >= threshold:
            found.append((round(score, 2), a.id, b.id))
    return sorted(found, reverse=True)


def test_no_two_questions_of_the_bank_ask_the_same_thing_unless_grouped_or_related_on_purpose():
    """A near-duplicate is either one group of duplicates.json (a quiz or a mock asks one of them: a notebook's
    question and its exercise's, say) or a pair of RELATED, which asks different things in similar words."""
    grouped = {frozenset((a, b)) for g in bank.duplicate_groups() for a in g for b in g if a != b}
    related = {frozenset(pair) for pair in RELATED}
    ids = {q.id for q in QUESTIONS}
    assert all(set(pair) <= ids for pair in RELATED), "RELATED names a question the bank no longer has"
    loose = [f"{score:.2f} {a} | {b}" for score, a, b in near_duplicates(QUESTIONS)
             if frozenset((a, b)) not in grouped | related]
    assert not loose, ("near-duplicate questions: rewrite one to ask something else, remove the weaker, group them in "
                       "minikv/interview/data/duplicates.json, or add the pair to RELATED with the reason:\n"
                       + "\n".join(loose))


def test_the_near_duplicate_detector_flags_a_reworded_question_and_passes_a_different_one():
    def q(qid, text):
        return bank.Question(qid, text, "", "standard", "kv-size", None, bank.BEYOND)

    same = [q("a", "Llama-3-70B has 8 K/V heads. How much KV cache does each GPU hold at TP = 8, and at TP = 16?"),
            q("b", "Llama-3-70B has 8 KV heads. What does each GPU hold at TP = 8, and at TP = 16?")]
    other = [same[0], q("c", "Why does a block's key include its parent's key?")]
    assert [pair[1:] for pair in near_duplicates(same)] == [("a", "b")]
    assert near_duplicates(other) == []
