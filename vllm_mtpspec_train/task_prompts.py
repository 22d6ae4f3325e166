"""Training prompts for kinds of use that ShareGPT's first turns hold little of: translating,
summarizing and extracting from a given text, and choosing among lettered options.

A drafter trained on ShareGPT keeps the fewest tokens a step on exactly these kinds among the
sources it never trained on (translation, multiple-choice QA, summaries). Their answers lean
on the prompt (names, numbers and phrases carried over, options repeated), which a drafter
only learns to read from its context if it has seen such answers. The texts come from what
the drafters already train on, or from a package no held-out source uses:
- ShareGPT's training split (never a held-out conversation: vllm_mtpspec.sharegpt.is_held_out),
  its human turns and the dataset's own answers, as the text to translate or summarize;
- chatterbot-corpus (BSD-3-Clause, pinned in scripts/setup.sh): its non-English lines to
  translate into English, and its English question/answer pairs as multiple-choice questions,
  the wrong options drawn from other answers of the same topic.

The requests are phrased several ways, none of them the held-out sources' own wording, so the
held-out figures stay a measure of prompts the drafter never saw. The target answers them
(vllm_mtpspec_train.data), so the labels are its own. Ids name the text they wrap; one made
from a ShareGPT text reads `<kind>:sharegpt:<conversation id>:<turn>`, the form
vllm_mtpspec.sharegpt.conversation_of knows, so the held-out audit sees whose conversation it
quotes. Each kind is in a fixed order, by a hash of the id.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path

from vllm_mtpspec.held_out_sources import _ordered, package_dir
from vllm_mtpspec.prompts import Prompt, PromptsError
from vllm_mtpspec.sharegpt import is_held_out, iter_sharegpt, sharegpt_path
from vllm_mtpspec_train.package_prompts import _template

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese")
TRANSLATE_TEMPLATES = (
    "Please translate the following text into {language}.\n\n{text}",
    "How would you say this in {language}?\n\n\"{text}\"",
    "{text}\n\nTranslate the text above to {language}, keeping its meaning and tone.",
    "Give me a {language} version of this:\n{text}",
)
TO_ENGLISH_TEMPLATES = (
    "What does this {language} text mean in English?\n\n{text}",
    "Translate from {language} to English:\n{text}",
)
SUMMARY_TEMPLATES = (
    "Summarize this in three sentences:\n\n{text}",
    "{text}\n\nWhat are the key points of the text above? List them.",
    "Extract every name, number, date and technical term from this text, grouped by kind:\n\n{text}",
    "Rewrite this so a twelve-year-old could follow it:\n\n{text}",
    "Here is a text.\n\n{text}\n\nWrite a one-paragraph summary and a title for it.",
)
CHOICE_TEMPLATES = (
    "{question}\n\n{options}\n\nPick the correct option and say why.",
    "Question: {question}\nOptions:\n{options}\nAnswer with the letter first, then a one-line justification.",
    "Choose the best answer.\n{question}\n{options}",
)
# chatterbot-corpus folder -> the language's English name (folders of scripts the target's
# tokenizer splits into bytes are left out: its answers there are noise).
CHATTERBOT_LANGUAGES = {"french": "French", "spanish": "Spanish", "german": "German", "italian": "Italian",
                        "portuguese": "Portuguese", "dutch": "Dutch", "swedish": "Swedish", "turkish": "Turkish",
                        "indonesian": "Indonesian"}
TRANSLATE_WORDS = (12, 80)          # a sentence or a short paragraph
SUMMARY_CHARS = (600, 3000)         # shorter says too little to summarize; longer is cut here


def _hash(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16)


def lettered(options: list[str]) -> str:
    """Options one a line, lettered A), B), ... as CHOICE_TEMPLATES ask."""
    return "\n".join(f"{letter}) {option}" for letter, option in zip("ABCDE", options))


def _training_texts() -> list[tuple[str, str]]:
    """(id, text) of every human turn and dataset answer of ShareGPT's training split."""
    texts = []
    for record in iter_sharegpt(sharegpt_path()):
        conversation = str(record.get("id", ""))
        if not conversation or is_held_out(conversation):
            continue
        for turn, message in enumerate(record.get("conversations") or []):
            text = (message.get("value") or "").strip()
            if text:
                texts.append((f"{conversation}:{turn}", text))
    return texts


_CODE_OR_MARKUP = re.compile(r"```|<[a-z/]|\{|\}|\|")


def _first_paragraph(text: str) -> str | None:
    """The first paragraph of plain prose TRANSLATE_WORDS long, or None."""
    paragraph = text.split("\n\n", 1)[0].strip()
    words = len(paragraph.split())
    if TRANSLATE_WORDS[0] <= words <= TRANSLATE_WORDS[1] and not _CODE_OR_MARKUP.search(paragraph):
        return paragraph
    return None


def translation_prompts(texts: list[tuple[str, str]]) -> list[Prompt]:
    """Paragraphs of ShareGPT training texts (`_training_texts`) to translate, and chatterbot-corpus lines."""
    prompts = []
    for text_id, text in texts:
        paragraph = _first_paragraph(text)
        if paragraph is None:
            continue
        pid = f"translate:sharegpt:{text_id}"
        language = LANGUAGES[_hash(pid) % len(LANGUAGES)]
        prompts.append(Prompt(_template(TRANSLATE_TEMPLATES, pid).format(language=language, text=paragraph),
                              "translation", pid))
    for folder, language in CHATTERBOT_LANGUAGES.items():
        for number, (file, conversation) in enumerate(_chatterbot(folder)):
            for line_number, line in enumerate(conversation):
                if len(line.split()) >= 6:
                    pid = f"translate:chatterbot:{folder}/{file}:{number}:{line_number}"
                    prompts.append(Prompt(_template(TO_ENGLISH_TEMPLATES, pid).format(language=language, text=line),
                                          "translation", pid))
    return prompts


def summary_prompts(texts: list[tuple[str, str]]) -> list[Prompt]:
    """ShareGPT training texts (`_training_texts`) to summarize, list the points of or extract from."""
    prompts = []
    for text_id, text in texts:
        if len(text) < SUMMARY_CHARS[0] or text.count("```") > 0:
            continue
        text = text[:SUMMARY_CHARS[1]].rsplit(" ", 1)[0] if len(text) > SUMMARY_CHARS[1] else text
        pid = f"summarize:sharegpt:{text_id}"
        prompts.append(Prompt(_template(SUMMARY_TEMPLATES, pid).format(text=text), "summarization", pid))
    return prompts


def choice_prompts() -> list[Prompt]:
    """Each English question with its answer among three answers to other questions of its topic."""
    prompts: dict[str, Prompt] = {}  # by id: the corpus repeats some questions
    for file, pairs in _chatterbot_questions().items():
        answers = sorted({answer for _, answer in pairs})
        right: dict[str, set[str]] = {}   # the corpus asks some questions twice, answering each way
        for question, answer in pairs:
            right.setdefault(question, set()).add(answer)
        for question, answer in pairs:
            pid = f"choice:chatterbot:english/{file}:{_hash(question) % 10**8}"
            others = [a for a in answers if a not in right[question]]
            if len(others) < 3:
                continue
            start = _hash(pid) % len(others)
            options = [answer] + [others[(start + i * 7) % len(others)] for i in range(3)]
            if len(set(options)) < 4:
                continue
            options.sort(key=lambda option: _hash(pid + option))
            question = question[0].upper() + question[1:] + ("" if question.endswith("?") else "?")
            prompts[pid] = Prompt(_template(CHOICE_TEMPLATES, pid).format(question=question, options=lettered(options)), "qa", pid)
    return list(prompts.values())


def _chatterbot(folder: str) -> list[tuple[str, list[str]]]:
    """(file name, its lines) of each conversation in one language folder of chatterbot-corpus."""
    import yaml

    root = package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / folder
    if not root.is_dir():
        raise PromptsError(f"chatterbot-corpus has no data/{folder}/ in {root.parent}: "
                           "pip install --no-deps chatterbot-corpus==1.3.3 (scripts/setup.sh pins it)")
    found = []
    for path in sorted(root.glob("*.yml")):
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for conversation in document.get("conversations") or []:
            lines = [str(line).strip() for line in conversation if isinstance(line, (str, int, float))]
            found.append((path.name, [line for line in lines if line]))
    return found


def _chatterbot_questions() -> dict[str, list[tuple[str, str]]]:
    """English file -> (question, first answer) pairs, questions being lines that ask and
    answers one line long (a lettered option cannot hold a code block)."""
    questions: dict[str, list[tuple[str, str]]] = {}
    for file, lines in _chatterbot("english"):
        if (len(lines) >= 2 and re.match(r"(what|who|which|when|where|how|why|is|are|do|does|can)\b", lines[0], re.I)
                and "\n" not in lines[1] and len(lines[1]) <= 200):
            questions.setdefault(Path(file).stem, []).append((lines[0], lines[1]))
    return questions


def task_prompts() -> list[Prompt]:
    """Every prompt of the three kinds, taking turns (each kind in its fixed order), so that
    the first N prompts hold the kinds alike until the smallest runs out."""
    texts = _training_texts()  # read once: both kinds wrap the same texts
    kinds = [_ordered(prompts) for prompts in (translation_prompts(texts), summary_prompts(texts), choice_prompts())]
    return [prompt for turn in itertools.zip_longest(*kinds) for prompt in turn if prompt is not None]
