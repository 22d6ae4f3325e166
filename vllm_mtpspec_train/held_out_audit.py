"""Held-out answers the drafter never saw: drop every held-out prompt that comes from a
conversation the training answers hold a part of, or that nearly repeats a training prompt.

A split by prompt id overstates what new prompts get: ShareGPT cuts long conversations into
parts with their own ids, and many users asked the same thing. The audit reads both sides'
answer files (their prompts as the target saw them, as token ids), says what it removed and
why, and writes the held-out answers that remain in the same format."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_mtpspec.answers import AnswersError, list_answer_files, read_answers, write_answers
from vllm_mtpspec.near_duplicates import SHINGLE, THRESHOLD, near_duplicates
from vllm_mtpspec.sharegpt import conversation_of

logger = logging.getLogger(__name__)


@dataclass
class Audit:
    held_out: int = 0
    same_conversation: list[str] = field(default_factory=list)  # held-out ids whose conversation is trained on
    near_duplicate: list[dict] = field(default_factory=list)    # {id, train_id, similarity}
    kept: int = 0
    threshold: float = THRESHOLD
    shingle_tokens: int = SHINGLE
    train_prompts: int = 0

    @property
    def removed(self) -> set[str]:
        return set(self.same_conversation) | {m["id"] for m in self.near_duplicate}

    def summary(self) -> str:
        return (f"{self.held_out} held-out prompts against {self.train_prompts} training prompts: "
                f"{len(self.same_conversation)} from a conversation trained on, {len(self.near_duplicate)} "
                f"more near-duplicates of a training prompt (Jaccard of {self.shingle_tokens}-token shingles "
                f">= {self.threshold}); {self.kept} kept")


def _read_dirs(dirs: list[str]) -> list[dict]:
    files = [path for folder in dirs for path in list_answer_files(folder)]
    if not files:
        raise AnswersError(f"no answers-*.npz files in {', '.join(dirs)} (training answers: bash "
                           "scripts/restore_answers.sh restores the committed ones)")
    return [read_answers(path) | {"path": path} for path in files]


def request_tokens(prompts: list[list[int]], *, share: float = 0.9) -> list[list[int]]:
    """The prompts without what nearly all of them share at both ends (the chat template's
    system turn before, the assistant's header after), so that a short request is compared
    by its own words, not by the template it shares with every other. Each end is the
    longest one that at least `share` of the prompts have; a prompt cut from the left, or
    made without a system turn, keeps what it does not share."""
    head = _shared_end(prompts, share)
    tail = _shared_end([p[::-1] for p in prompts], share)
    out = []
    for prompt in prompts:
        start = _common_length(prompt, head)
        stop = len(prompt) - _common_length(prompt[::-1], tail)
        out.append(prompt[start:max(start, stop)])
    return out


def _shared_end(prompts: list[list[int]], share: float) -> list[int]:
    """The longest token sequence that at least `share` of the prompts begin with."""
    end: list[int] = []
    agreeing = prompts
    while True:
        position = len(end)
        counts: dict[int, int] = {}
        for p in agreeing:
            if len(p) > position:
                counts[p[position]] = counts.get(p[position], 0) + 1
        if not counts:
            return end
        token, count = max(counts.items(), key=lambda item: item[1])
        if count < share * len(prompts):
            return end
        end.append(token)
        agreeing = [p for p in agreeing if len(p) > position and p[position] == token]


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def audit_held_out(train_dirs: list[str], held_out_dirs: list[str], *, threshold: float = THRESHOLD) -> Audit:
    train = _read_dirs(train_dirs)
    held = _read_dirs(held_out_dirs)
    train_ids = [i for f in train for i in f["ids"]]
    held_ids = [i for f in held for i in f["ids"]]
    trained_conversations = {conversation_of(i) for i in train_ids}
    audit = Audit(held_out=len(held_ids), train_prompts=len(train_ids), threshold=threshold)
    audit.same_conversation = [i for i in held_ids if conversation_of(i) in trained_conversations]
    requests = request_tokens([p for f in train + held for p in f["prompt_ids"]])
    train_requests, held_requests = requests[:len(train_ids)], requests[len(train_ids):]
    same = set(audit.same_conversation)
    for match in near_duplicates(held_requests, train_requests, threshold=threshold):
        if held_ids[match.query] not in same:
            audit.near_duplicate.append({"id": held_ids[match.query], "train_id": train_ids[match.corpus],
                                         "similarity": round(match.similarity, 3)})
    audit.kept = audit.held_out - len(audit.removed)
    return audit


def write_clean(held_out_dirs: list[str], audit: Audit, out: str | Path, *, train_dirs: list[str]) -> list[Path]:
    """The held-out answers the audit kept, in answer files of the same format (one per
    input file that keeps any), with the audit in their meta."""
    written = []
    removed = audit.removed
    for index, answers in enumerate(_read_dirs(held_out_dirs)):
        keep = [j for j, i in enumerate(answers["ids"]) if i not in removed]
        if not keep:
            continue
        meta = {k: v for k, v in answers["meta"].items() if k not in ("format", "model_fingerprint", "vocab_size")}
        meta["audited_against"] = {"train_answers": train_dirs, "removed": len(answers["ids"]) - len(keep),
                                   "source": str(answers["path"])}
        written.append(write_answers(Path(out) / f"answers-{index:05d}.npz",
                                     [answers["ids"][j] for j in keep], [answers["categories"][j] for j in keep],
                                     [answers["prompt_ids"][j] for j in keep], [answers["answers"][j] for j in keep],
                                     fingerprint=answers["meta"]["model_fingerprint"],
                                     vocab_size=answers["meta"]["vocab_size"], **meta))
    report = Path(out) / "audit.json"
    report.write_text(json.dumps(asdict(audit), indent=1) + "\n")
    written.append(report)
    return written
