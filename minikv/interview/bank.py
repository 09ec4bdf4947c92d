"""The interview question bank: every question the course asks, with its model answer, and the
questions interviews ask beyond the course.

    data/notebooks.json  the questions the notebooks ask, with the instructor key's answers (written by
                         instructor/bank_import.py; edit difficulty, topic and follow-ups here); in every copy
    data/course.json     the same for the exercises (graded work: held back from a student copy)
    data/beyond.json     questions on what the course does not build (MLA, speculative decoding, ...)
    data/interview.json  what interviews for inference roles ask: speculative decoding, parallelism,
                         quantization, serving metrics, system design; each follow-up with its answer
    data/duplicates.json groups of questions that ask the same thing (a notebook's question and its
                         exercise's, say): a quiz or a mock asks at most one of each group

Each entry:

    id          "04_paged_kv-q1", "beyond-littles-law"
    question    the question, as an interviewer would ask it
    answer      a model answer (a few sentences, with the figures)
    follow_ups  what an interviewer asks next (at least one)
    follow_up_answers  the model answer to each follow-up, in the same order (where written)
    difficulty  "warm-up" | "standard" | "hard"
    topic       one of TOPICS
    notebook    the notebook or exercise that teaches it ("notebooks/04_paged_kv.ipynb"), or None:
                beyond the course
    heading     the heading of the section that teaches it, or "beyond the course"

JSON and not YAML: the standard library reads it, so the bank adds no dependency.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
FILES = ("notebooks.json", "course.json", "beyond.json", "interview.json")
DIFFICULTIES = ("warm-up", "standard", "hard")
BEYOND = "beyond the course"
TOPICS = {
    "kv-size": "how big the KV cache is: MHA, GQA, MQA, MLA, tensor parallelism",
    "attention": "causal attention, masks, scaling, GQA head grouping",
    "rope": "rotary positions and what they mean for caching and padding",
    "prefill-decode": "prefill against decode, compute- and memory-bound, the roofline",
    "batching": "static batching, padding, slot utilisation",
    "paged-kv": "blocks, block tables, slot mapping, fragmentation, pool sizing",
    "scheduling": "continuous batching, token budgets, chunked prefill, admission",
    "preemption": "recompute against swap, victims, vLLM V0 and V1",
    "prefix-caching": "hash chain, radix tree, eviction, salts, API prompt caching",
    "sharing": "forks, copy-on-write, parallel sampling, beam search",
    "kernels": "paged decode kernels, online softmax, split-K, FlashAttention, FlashInfer, CUDA graphs",
    "measurement": "timing methodology, profilers",
    "serving-metrics": "TTFT, TPOT, p99, goodput, Little's law",
    "speculative-decoding": "drafts, verification, acceptance, KV rollback",
    "kv-compression": "KV quantization, sliding windows, attention sinks, H2O, SnapKV",
    "disaggregation": "prefill/decode disaggregation, KV transfer, offload tiers",
    "parallelism": "tensor, pipeline, data and context parallelism",
    "system-design": "sizing a deployment end to end",
    "quantization": "weight and KV quantization: int8, fp8, int4, AWQ, GPTQ, and how to evaluate them",
    "moe": "mixture of experts: routing, expert parallelism, DP attention, MLA",
    "production": "batch invariance, structured output, multi-LoRA, distillation, reliability",
}
ALIASES = {  # what people type -> the topic
    "spec": "speculative-decoding", "speculative": "speculative-decoding", "spec-decoding": "speculative-decoding",
    "tp": "parallelism", "pp": "parallelism", "ep": "moe", "tensor-parallelism": "parallelism",
    "quant": "quantization", "fp8": "quantization", "int8": "quantization", "awq": "quantization",
    "gptq": "quantization", "metrics": "serving-metrics", "slo": "serving-metrics", "mbu": "serving-metrics",
    "mfu": "serving-metrics", "goodput": "serving-metrics", "design": "system-design", "sizing": "system-design",
    "prefix": "prefix-caching", "cache": "prefix-caching", "paged": "paged-kv", "paging": "paged-kv",
    "flash": "kernels", "flashattention": "kernels", "cuda-graphs": "kernels", "kv": "kv-size",
    "mla": "moe", "experts": "moe", "mixture-of-experts": "moe", "pd": "disaggregation",
    "disagg": "disaggregation", "lora": "production", "structured-output": "production",
}


def resolve_topic(name: str) -> str:
    """A topic or an alias of one; a ValueError names the closest topic otherwise."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in TOPICS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    import difflib

    near = difflib.get_close_matches(key, list(TOPICS) + list(ALIASES), n=1, cutoff=0.5)
    hint = f"; did you mean {ALIASES.get(near[0], near[0])!r}?" if near else ""
    raise ValueError(f"unknown topic {name!r}{hint} (`minikv quiz --topics` lists them)")


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    difficulty: str
    topic: str
    notebook: str | None
    heading: str
    follow_ups: list[str] = field(default_factory=list)
    follow_up_answers: list[str] = field(default_factory=list)

    @property
    def beyond_course(self) -> bool:
        return self.notebook is None

    @property
    def where(self) -> str:
        return BEYOND if self.notebook is None else f"{self.notebook}, section \"{self.heading}\""

    def to_dict(self) -> dict:
        return asdict(self)


def load(data: Path = DATA) -> list[Question]:
    """Every question of the bank, course first, in file order."""
    out: list[Question] = []
    for name in FILES:
        if not (data / name).is_file():  # a student copy holds back course.json (the instructor key's answers)
            continue
        for raw in json.loads((data / name).read_text()):
            out.append(Question(raw["id"], unwrap(raw["question"]), unwrap(raw["answer"]), raw["difficulty"],
                                raw["topic"], raw["notebook"], raw["heading"],
                                [unwrap(f) for f in raw.get("follow_ups", [])],
                                [unwrap(a) for a in raw.get("follow_up_answers", [])]))
    return out


def unwrap(text: str) -> str:
    """One line per paragraph: the instructor key wraps its answers at its own width ('first-' at the end
    of a line and 'cached' on the next is 'first-cached'). Blank lines and list items stay."""
    paragraphs = []
    for para in text.strip().split("\n\n"):
        out = ""
        for line in para.split("\n"):
            line = line.strip()
            if not out:
                out = line
            elif line[:2] in ("- ", "* ") or line[:1].isdigit() and line[1:3] in (". ", ") "):
                out += "\n" + line
            elif len(out) > 1 and out[-1] == "-" and out[-2].isalnum() and line[:1].islower():
                out += line
            else:
                out += " " + line
        paragraphs.append(out)
    return "\n\n".join(paragraphs)


def duplicate_groups(data: Path = DATA) -> list[list[str]]:
    path = data / "duplicates.json"
    return json.loads(path.read_text()) if path.is_file() else []


def one_per_group(questions: list[Question], groups: list[list[str]] | None = None) -> list[Question]:
    """The questions in order, dropping any whose group already has a question earlier in the list."""
    group_of = {qid: i for i, g in enumerate(duplicate_groups() if groups is None else groups) for qid in g}
    seen: set[int] = set()
    out = []
    for q in questions:
        g = group_of.get(q.id)
        if g is not None:
            if g in seen:
                continue
            seen.add(g)
        out.append(q)
    return out


def select(questions: list[Question], topic: str | None = None, difficulty: str | None = None,
           beyond: bool | None = None) -> list[Question]:
    """The questions of one topic and/or difficulty; beyond=True only those beyond the course, False none."""
    if topic is not None:
        topic = resolve_topic(topic)
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(DIFFICULTIES)}")
    return [q for q in questions
            if (topic is None or q.topic == topic) and (difficulty is None or q.difficulty == difficulty)
            and (beyond is None or q.beyond_course == beyond)]


def draw(questions: list[Question], n: int, seed: int | None = None) -> list[Question]:
    """n questions in random order (all of them if there are fewer)."""
    rng = random.Random(seed)
    return one_per_group(rng.sample(questions, len(questions)))[:n]


def problems(questions: list[Question], root: Path | None = None) -> list[str]:
    """What is wrong with the bank, one line per fault (empty: nothing). With `root` (a course checkout),
    each notebook must exist there and its heading must be one of the notebook's headings."""
    faults: list[str] = []
    seen: set[str] = set()
    headings: dict[str, set[str]] = {}
    for q in questions:
        where = f"{q.id}:"
        if q.id in seen:
            faults.append(f"{where} the id is used twice")
        seen.add(q.id)
        if len(q.question.strip()) < 15:
            faults.append(f"{where} no question")
        if not 80 <= len(q.answer.strip()) <= 1600:
            faults.append(f"{where} an answer of {len(q.answer.strip())} characters; give a model answer of a "
                          "few sentences (80 to 1,600 characters)")
        if q.difficulty not in DIFFICULTIES:
            faults.append(f"{where} difficulty {q.difficulty!r}; use one of {', '.join(DIFFICULTIES)}")
        if q.topic not in TOPICS:
            faults.append(f"{where} topic {q.topic!r}; use one of {', '.join(TOPICS)} (or add it to TOPICS)")
        if not q.follow_ups or not all(isinstance(f, str) and f.strip() for f in q.follow_ups):
            faults.append(f"{where} no follow-up question; add one to follow_ups")
        if q.follow_up_answers and len(q.follow_up_answers) != len(q.follow_ups):
            faults.append(f"{where} {len(q.follow_ups)} follow-ups but {len(q.follow_up_answers)} follow-up answers; "
                          "answer each, in order")
        if q.notebook is None:
            if q.heading != BEYOND:
                faults.append(f"{where} no notebook, so the heading must say {BEYOND!r}")
            continue
        if root is None:
            continue
        path = root / q.notebook
        if not path.exists():
            faults.append(f"{where} notebook {q.notebook} does not exist; point to a notebook of the course, "
                          f"or set notebook to null ({BEYOND})")
            continue
        if q.notebook not in headings:
            headings[q.notebook] = set(notebook_headings(path))
        if q.heading not in headings[q.notebook]:
            faults.append(f"{where} {q.notebook} has no heading {q.heading!r}")
    return faults


def notebook_headings(path: Path) -> list[str]:
    """The markdown headings of a notebook, without their '#'."""
    out = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        out += [line.lstrip("#").strip() for line in src.splitlines() if line.startswith("#")]
    return out


def export_json(questions: list[Question]) -> str:
    return json.dumps([q.to_dict() for q in questions], indent=1, ensure_ascii=False)


def export_markdown(questions: list[Question]) -> str:
    """A study sheet: each question with its id, where it is taught, the answer and the follow-ups."""
    out = [f"# minikv interview questions ({len(questions)})", ""]
    for q in questions:
        out += [f"## {q.question}", "", f"`{q.id}` · {q.topic} · {q.difficulty} · {q.where}", "", q.answer, ""]
        for i, f in enumerate(q.follow_ups):
            out.append(f"- **Follow-up:** {f}")
            if i < len(q.follow_up_answers):
                out.append(f"  {q.follow_up_answers[i]}")
        out.append("")
    return "\n".join(out)


def export_anki(questions: list[Question]) -> str:
    """Tab-separated cards for Anki's import (front, back, tags); newlines become <br>."""
    def cell(text: str) -> str:
        return text.replace("\t", " ").replace("\n", "<br>")

    rows = ["#separator:tab", "#html:true", "#tags column:3"]
    for q in questions:
        back = q.answer + "".join(
            f"<br><br><b>Follow-up:</b> {f}" + (f"<br>{q.follow_up_answers[i]}" if i < len(q.follow_up_answers) else "")
            for i, f in enumerate(q.follow_ups))
        rows.append("\t".join([cell(q.question), cell(back), f"minikv {q.topic} {q.difficulty} {q.id}"]))
    return "\n".join(rows) + "\n"
