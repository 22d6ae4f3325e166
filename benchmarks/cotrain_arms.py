"""Co-training against its control, side by side: a student with its drafter, per arm.

    python benchmarks/cotrain_arms.py \
        --arm "cut, untrained=runs/cotrain/student-l15" \
        --arm "(a) distilled, then a post-hoc drafter=runs/cotrain/a-student/student,runs/cotrain/a-drafter" \
        --arm "(b) co-trained=runs/cotrain/b/student,runs/cotrain/b" \
        --held-out "ShareGPT first turns=data/self-distilled/smollm2-135m-instruct/held-out-audited:runs/cotrain/teacher-held-out-audited" \
        --work-dir runs/cotrain/eval --json benchmarks/results/cotrain_arms.json --markdown benchmarks/results/cotrain_arms.md

Each arm is LABEL=STUDENT[,DRAFTER]; each held-out set LABEL=ANSWERS:TEACHER_SHARDS, the
teacher's answers and the folder of its pass along them (written here where it is missing).
Per arm and set:
- the student: top-1 agreement with the teacher and the KD loss the job trains (KL of the
  teacher's top-8 from the student), along the teacher's held-out answers;
- the drafter: depth-1 top-1 and the chain's mean accepted length, teacher-forced along the
  student's own greedy answers to the same prompts (what greedy speculation on that
  student keeps), with its states;
- the training budget: steps, answers read and wall-clock of every run that made the arm
  (the student's and the drafter's train_summary.json).
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from vllm_mtpspec.answers import answers_path, list_answer_files, read_answers, write_answers
from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec.checkpoint import load_heads, model_fingerprint
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.target import load_target
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.answers import shards_from_answers
from vllm_mtpspec_train.config import what_trains
from vllm_mtpspec_train.losses import kd_loss


def labelled(spec: str) -> tuple[str, str]:
    label, sep, value = spec.partition("=")
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"{spec!r}: write LABEL=VALUE")
    return label, value


@torch.no_grad()
def student_quality(student, teacher_shards: list[Path]) -> dict:
    """Top-1 agreement with the teacher and KD loss along the teacher's answers, overall and
    per source (the answers' category)."""
    sums = defaultdict(lambda: torch.zeros(3, dtype=torch.float64))  # agreeing rows, KD summed, rows
    for path in teacher_shards:
        shard = torch.load(path, weights_only=True)
        for j, category in enumerate(shard["categories"]):
            start, end = int(shard["offsets"][j]), int(shard["offsets"][j + 1])
            prompt = list(shard["prompt_ids"][j])
            ids = torch.tensor([prompt + shard["tokens"][start:end].tolist()])
            logits = student(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + end - start].float()
            top_ids = shard["topk_ids"][start:end]
            kd = kd_loss(logits, top_ids, shard["topk_logprobs"][start:end].float(),
                         torch.ones(end - start, dtype=torch.bool))
            row = torch.tensor([(logits.argmax(-1) == top_ids[:, 0]).sum().item(), kd.item() * (end - start),
                                end - start], dtype=torch.float64)
            sums["all"] += row
            sums[category] += row
    return {group: {"top1_agreement": round(float(s[0] / s[2]), 4), "kd": round(float(s[1] / s[2]), 4),
                    "rows": int(s[2])} for group, s in sums.items()}


def student_answers(student_dir: str, llm, teacher_answers: str, out: Path, max_new_tokens: int) -> Path:
    """The student's greedy answers to the prompts of the teacher's answer files, one file each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
    fingerprint = model_fingerprint(student_dir)
    for index, path in enumerate(list_answer_files(teacher_answers)):
        if answers_path(out, index).is_file():
            continue
        kept = read_answers(path)
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in kept["prompt_ids"]], params, use_tqdm=False)
        write_answers(answers_path(out, index), kept["ids"], kept["categories"], kept["prompt_ids"],
                      [list(o.outputs[0].token_ids) for o in outputs], fingerprint=fingerprint,
                      vocab_size=llm.llm_engine.model_config.get_vocab_size(), max_new_tokens=max_new_tokens)
    return out


def budget(student_dir: str, drafter_dir: str | None) -> dict:
    """Steps, answers read and seconds of each run behind the arm (a co-trained arm is one)."""
    runs = {}
    for folder in [Path(student_dir).parent, Path(drafter_dir) if drafter_dir else None]:
        summary = folder / "train_summary.json" if folder else None
        if summary and summary.is_file():
            s = json.loads(summary.read_text())
            config = s["config"]
            runs[str(folder)] = {"steps": s["steps"], "seconds": s["seconds"],
                                 "answers_read": s["steps"] * config["batch_size"] * config["num_workers"],
                                 "trains": what_trains(config["mode"], config["mtp_weight"], config["freeze_student"])}
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", type=labelled, required=True, metavar="LABEL=STUDENT[,DRAFTER]")
    parser.add_argument("--held-out", action="append", type=labelled, required=True,
                        metavar="LABEL=ANSWERS:TEACHER_SHARDS")
    parser.add_argument("--teacher", default="smollm2-135m-instruct", help="the model that wrote the held-out answers")
    parser.add_argument("--work-dir", required=True, help="the students' answers and shards are written here")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="of the students' greedy answers")
    parser.add_argument("--context-rows", type=int, default=512)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    from vllm_mtpspec_train.data import greedy_engine

    sets = []
    for label, value in args.held_out:
        answers, sep, shards = value.partition(":")
        if not sep or not shards or not list_answer_files(answers):
            parser.error(f"--held-out {label}: {value!r} is not ANSWERS:TEACHER_SHARDS with answer files in ANSWERS")
        shards_from_answers(resolve_model(args.teacher, dtype="fp32"), answers, shards)  # the teacher's top-8
        sets.append((label, answers, list_shards(shards)))
    results = {"stamp": stamp(), "max_new_tokens": args.max_new_tokens, "arms": {}}
    qualities: dict[tuple[str, str], dict] = {}
    for arm, value in args.arm:
        student_dir, _, drafter_dir = value.partition(",")
        student = load_target(student_dir, dtype="fp32")
        entry = {"student": student_dir, "drafter": drafter_dir or None, "budget": budget(student_dir, drafter_dir),
                 "sets": {}}
        llm = greedy_engine(student_dir, max_model_len=2048 + args.max_new_tokens, kv_cache_bytes=1 << 30) \
            if drafter_dir else None
        block = load_heads(drafter_dir) if drafter_dir else None
        embed, lm_head = embedding_and_lm_head(student_dir)
        for s, (label, answers, teacher_shards) in enumerate(sets):
            if (student_dir, label) not in qualities:  # several drafters of one student: measured once
                qualities[student_dir, label] = student_quality(student.model, teacher_shards)
            scores = {"student": qualities[student_dir, label]}
            if block is not None:
                from vllm_mtpspec_train.evaluate import evaluate_heads

                # One student's answers and states serve every drafter of that student.
                work = Path(args.work_dir) / student_dir.strip("/").replace("/", "_") / f"set{s}"
                student_answers(student_dir, llm, answers, work / "answers", args.max_new_tokens)
                shards_from_answers(student_dir, work / "answers", work / "shards", context_rows=args.context_rows)
                report = evaluate_heads(block, list_shards(work / "shards"), lm_head=lm_head, embed=embed,
                                        trees=("chain",), prompt_lookup=None)
                scores["drafter"] = {"top1": report["top1"], "mean_accepted_len": report["mean_accepted_len"]["chain"],
                                     "rows": report["rows"],
                                     "per_source": {c: {"top1": v["top1"][0],
                                                        "mean_accepted_len": v["mean_accepted_len"]["chain"]}
                                                    for c, v in report["per_category"].items()}}
            entry["sets"][label] = scores
            print(arm, label, json.dumps(scores)[:300], flush=True)
        results["arms"][arm] = entry
        del llm
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))


def markdown(results: dict) -> str:
    s = results["stamp"]
    lines = [f"## Co-training's arms: {len(results['arms'])} students with their drafters", "",
             describe(s), "", f"`{s['command']}`", "",
             "Student: along the teacher's held-out answers. Drafter: teacher-forced along the student's own greedy "
             f"answers to the same prompts ({results['max_new_tokens']} new tokens), a chain of every depth.", "",
             "| arm | held-out set | student top-1 agreement | student KD | drafter depth-1 top-1 | chain accepted |",
             "|---|---|---|---|---|---|"]
    for arm, entry in results["arms"].items():
        for label, scores in entry["sets"].items():
            st, dr = scores["student"]["all"], scores.get("drafter")
            drafted = f"{dr['top1'][0]:.3f} | {dr['mean_accepted_len']:.2f}" if dr else "- | -"
            lines.append(f"| {arm} | {label} | {st['top1_agreement']:.3f} | {st['kd']:.3f} | {drafted} |")
    lines += ["", "### Training budget", "", "| arm | run | trains | steps | answers read | wall-clock |",
              "|---|---|---|---|---|---|"]
    for arm, entry in results["arms"].items():
        for run, b in entry["budget"].items():
            lines.append(f"| {arm} | `{run}` | {b['trains']} | {b['steps']} | {b['answers_read']:,} | "
                         f"{b['seconds'] / 60:.1f} min |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
