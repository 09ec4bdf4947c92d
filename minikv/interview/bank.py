"""The interview question bank: every question the course asks, with its model answer, and the
questions interviews ask beyond the course.

    data/course.json   the course's own questions and the instructor key's answers
                       (written by instructor/bank_import.py; edit difficulty, topic and follow-ups here)
    data/beyond.json   questions on what the course does not build (MLA, speculative decoding, ...)

Each entry:

    id          "04_paged_kv-q1", "beyond-littles-law"
    question    the question, as an interviewer would ask it
    answer      a model answer (a few sentences, with the figures)
    follow_ups  what an interviewer asks next (at least one)
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
FILES = ("course.json", "beyond.json")
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
}


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
            out.append(Question(raw["id"], raw["question"], raw["answer"], raw["difficulty"], raw["topic"],
                                raw["notebook"], raw["heading"], list(raw.get("follow_ups", []))))
    return out


def select(questions: list[Question], topic: str | None = None, difficulty: str | None = None,
           beyond: bool | None = None) -> list[Question]:
    """The questions of one topic and/or difficulty; beyond=True only those beyond the course, False none."""
    if topic is not None and topic not in TOPICS:
        raise ValueError(f"unknown topic {topic!r}; topics: {', '.join(TOPICS)}")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {', '.join(DIFFICULTIES)}")
    return [q for q in questions
            if (topic is None or q.topic == topic) and (difficulty is None or q.difficulty == difficulty)
            and (beyond is None or q.beyond_course == beyond)]


def draw(questions: list[Question], n: int, seed: int | None = None) -> list[Question]:
    """n questions in random order (all of them if there are fewer)."""
    rng = random.Random(seed)
    return rng.sample(questions, min(n, len(questions)))


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
