"""Training prompts from JSONL, ShareGPT JSON or plain text (the held-out split is
vllm_mtpspec.sharegpt.is_held_out, shared with the bench)."""
from __future__ import annotations

from pathlib import Path

from vllm_mtpspec.held_out_sources import held_out_prompts
from vllm_mtpspec.prompts import Prompt, PromptsError, load_prompts_jsonl
from vllm_mtpspec.sharegpt import guess_category, iter_sharegpt, sharegpt_later_turns, sharegpt_path, sharegpt_prompts
from vllm_mtpspec_train.dataframebench import dataframebench_prompts
from vllm_mtpspec_train.exam_prompts import exam_prompts
from vllm_mtpspec_train.package_prompts import package_prompts, package_texts
from vllm_mtpspec_train.task_prompts import task_prompts

PROMPT_SOURCES = {"sharegpt": sharegpt_prompts, "sharegpt-later-turns": sharegpt_later_turns,
                  "dataframebench": dataframebench_prompts, "package-docs": package_prompts, "tasks": task_prompts,
                  "exams": exam_prompts}


def sharegpt_texts() -> list[tuple[Prompt, str]]:
    """ShareGPT's first turns with the dataset's own answers (what Medusa-1 and EAGLE-1 train on)."""
    answers = sharegpt_answers()
    return [(p, answers[p.id]) for p in sharegpt_prompts() if answers.get(p.id, "").strip()]


# Sources of human-written answers: (prompt, text) pairs that the target labels instead of
# answering (vllm_mtpspec_train.data --human-text).
TEXT_SOURCES = {"sharegpt": sharegpt_texts, "package-docs": package_texts}


HELD_OUT_SOURCES = "held-out-sources"  # "held-out-sources[:N]": N prompts of each source the drafters never train on


def load_prompt_source(name: str) -> list[Prompt]:
    """A named source (PROMPT_SOURCES), the held-out sources ("held-out-sources:N", N per
    source, default 16), or a file (load_training_prompts)."""
    if name == HELD_OUT_SOURCES or name.startswith(f"{HELD_OUT_SOURCES}:"):
        count = name.partition(":")[2] or "16"
        if not count.isdigit():
            raise PromptsError(f"prompts {name!r}: write {HELD_OUT_SOURCES}:N with N a number of prompts per source")
        return held_out_prompts(per_source=int(count))
    source = PROMPT_SOURCES.get(name)
    return source() if source is not None else load_training_prompts(name)


def sharegpt_answers(path: str | Path | None = None) -> dict[str, str]:
    """Conversation id -> the dataset's answer to its first human turn (the text Medusa-1
    trains on)."""
    answers = {}
    for record in iter_sharegpt(path or sharegpt_path()):
        turns = record.get("conversations") or []
        first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
        if first is not None and first + 1 < len(turns) and turns[first + 1].get("from") == "gpt":
            answers[str(record.get("id"))] = turns[first + 1].get("value", "")
    return answers


def load_training_prompts(path: str | Path) -> list[Prompt]:
    """JSONL (`prompt`/`turns`), a ShareGPT JSON array, or plain text (a prompt per
    paragraph), told apart by content."""
    file = Path(path)
    if not file.is_file():
        raise PromptsError(f"prompts file {file} does not exist")
    with open(file, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    if not head:
        raise PromptsError(f"{file} is empty: the data set holds no prompts")
    if head.startswith("["):
        prompts = sharegpt_prompts(file)
    elif head.startswith("{"):
        prompts = load_prompts_jsonl(file)
    elif file.suffix in (".jsonl", ".json"):
        raise PromptsError(f"{file}: a .jsonl/.json file must hold JSON objects (JSONL) or a ShareGPT array")
    else:
        paragraphs = [p.strip() for p in file.read_text(encoding="utf-8", errors="replace").split("\n\n")]
        prompts = [Prompt(p, guess_category(p), f"{file.name}:{i}") for i, p in enumerate(paragraphs) if p]
    if not prompts:
        raise PromptsError(f"{file}: the data set holds no prompts")
    return prompts
