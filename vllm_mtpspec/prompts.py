"""Prompt files: JSONL with `prompt` (a string) or `turns` (strings; the first is used),
an optional `category`; and the chat template that chat models need."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PromptsError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = "general"
    id: str = ""
    # The conversation before this turn, oldest first: ("user" | "assistant", text) pairs.
    history: tuple[tuple[str, str], ...] = ()


def load_prompts_jsonl(path: str | Path, *, limit: int | None = None) -> list[Prompt]:
    file = Path(path)
    if not file.is_file():
        raise PromptsError(f"prompts file {file} does not exist")
    prompts: list[Prompt] = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise PromptsError(
                    f"{file}:{lineno}: not a JSON line ({err.msg}); a prompts file is JSONL, one "
                    'object per line such as {"prompt": "...", "category": "code"}'
                ) from None
            if not isinstance(row, dict):
                raise PromptsError(f"{file}:{lineno}: expected a JSON object, got {type(row).__name__}")
            if isinstance(row.get("prompt"), str):
                text = row["prompt"]
            elif isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
                text = row["turns"][0]
            else:
                raise PromptsError(
                    f"{file}:{lineno}: needs a string field 'prompt' or a list of strings 'turns'"
                )
            prompts.append(Prompt(text, str(row.get("category", "general")), str(row.get("id", lineno))))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise PromptsError(f"{file} holds no prompts")
    return prompts


def apply_chat_template(tokenizer, text: str, history: tuple[tuple[str, str], ...] = ()) -> str:
    """Chat models get their template over the conversation so far (with the assistant turn
    opened); base models the turns' texts, one after another."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": role, "content": content} for role, content in history]
        return tokenizer.apply_chat_template(
            messages + [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return "\n\n".join([content for _, content in history] + [text])


def prompt_ids(tokenizer, text: str, history: tuple[tuple[str, str], ...] = (), *,
               max_prompt_tokens: int | None = None) -> list[int]:
    """The prompt's token ids as the target reads them, the same for answer data, decode,
    the reference decoder and the bench. A chat template writes its own special tokens; a
    plain text gets the tokenizer's (the BOS that Gemma needs, nothing for SmolLM2), as
    vLLM's text prompts do. A conversation longer than max_prompt_tokens loses its oldest
    exchanges (user turn and answer together, so the template stays well formed); a single
    turn still too long keeps its last tokens (after the BOS the tokenizer put first)."""
    templated = bool(getattr(tokenizer, "chat_template", None))
    while True:
        ids = tokenizer.encode(apply_chat_template(tokenizer, text, history), add_special_tokens=not templated)
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            return ids
        if not history:
            break
        history = history[2:]
    bos = tokenizer.bos_token_id
    if not templated and bos is not None and ids[0] == bos and max_prompt_tokens > 1:
        return [bos] + ids[len(ids) - max_prompt_tokens + 1:]
    return ids[-max_prompt_tokens:]
