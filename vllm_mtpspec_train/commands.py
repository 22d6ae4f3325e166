"""The training job's subcommands of `mtpspec` (`train`, `eval-heads`), registered through
the `mtpspec.commands` entry points (pyproject.toml) that vllm_mtpspec/cli.py loads by
name: the library never imports this package. Every `mtpspec` run loads this module to
build its parser, so it imports torch, vLLM and Ray only inside the commands."""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from vllm_mtpspec.cli import TRAIN_EXTRA
from vllm_mtpspec.json_output import print_json

# What the train extra installs (pyproject.toml); a command that misses one says how to get it.
TRAIN_EXTRA_MODULES = ("ray", "matplotlib", "pyarrow")


def add_train_command(sub) -> None:
    p = sub.add_parser("train", help="train heads with Ray (see `mtpspec train --help`)", add_help=False,
                       description="Runs the Ray Train job; every argument goes to it.")
    # The Ray job owns its flags and --help: everything after `train` goes to it unparsed.
    p.set_defaults(func=run_train, passthrough=True)


def run_train(args, rest: list[str]) -> int:
    from vllm_mtpspec_train.train import main

    return needs_train_extra("train", main, rest)


def needs_train_extra(command: str, run, *args) -> int:
    """run(*args), or exit status 2 with the install line where a module of the train extra
    is missing."""
    try:
        return run(*args)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in TRAIN_EXTRA_MODULES:
            raise
        print(f"mtpspec {command}: error: {err.name} is not installed; the training job needs the train extra: "
              f"{TRAIN_EXTRA}", file=sys.stderr)
        return 2


def add_eval_heads_command(sub) -> None:
    p = sub.add_parser("eval-heads", help="per-head accuracy and mean accepted length along the model's greedy answers",
                       description="Generates the model's greedy answers to the prompts with vLLM (cached), then "
                                   "measures per head top-1/top-5 accuracy and the mean accepted length of the chain "
                                   "and consensus trees, per prompt category.")
    p.add_argument("--model", required=True, help="a known model name or a Hugging Face folder")
    p.add_argument("--heads", required=True, help="heads directory")
    p.add_argument("--prompts", required=True,
                   help="JSONL prompts, or folders of self-distillation shards separated by commas (one per source, "
                        "reported apart)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-tree-nodes", type=int, default=16)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_eval_heads)


def cmd_eval_heads(args) -> int:
    from vllm_mtpspec.checkpoint import read_heads_config
    from vllm_mtpspec.models import cache_root, resolve_model
    from vllm_mtpspec.prompts import load_prompts_jsonl
    from vllm_mtpspec.shards import CONTEXT_ROWS, list_shards
    from vllm_mtpspec.target import load_heads_for, load_target
    from vllm_mtpspec.weights import embedding_and_lm_head
    from vllm_mtpspec_train.data import generate_self_distillation
    from vllm_mtpspec_train.evaluate import evaluate_heads

    model_dir = resolve_model(args.model, dtype="fp32")
    # A draft block reads the context: its shards carry the prompt rows too, and the
    # states entering the target layers it reads.
    heads_config = read_heads_config(args.heads)
    context_rows = CONTEXT_ROWS if heads_config.kind.keeps_context else 0
    feature_layers = heads_config.feature_layers
    source = Path(args.prompts)
    folders = [Path(f) for f in args.prompts.split(",") if f]
    if all(f.is_dir() for f in folders):  # self-distillation shards already made, one folder per source
        shards = [shard for folder in folders for shard in list_shards(folder)]
    else:
        prompts = load_prompts_jsonl(source, limit=args.limit)
        key = hashlib.sha1(f"{model_dir}|{source.resolve()}|{source.stat().st_mtime}|{args.max_new_tokens}|{args.limit}"
                           f"{f'|context={context_rows}' if context_rows else ''}"
                           f"{f'|layers={feature_layers}' if feature_layers else ''}".encode()).hexdigest()[:12]
        data_dir = cache_root() / "eval-data" / key
        generate_self_distillation(model_dir, prompts, data_dir, max_new_tokens=args.max_new_tokens,
                                   context_rows=context_rows, feature_layers=feature_layers)
        shards = list_shards(data_dir)
    target = load_target(str(model_dir), dtype="fp32")
    heads = load_heads_for(target, args.heads)
    del target
    embed, lm_head = embedding_and_lm_head(model_dir)
    report = evaluate_heads(heads, shards, lm_head=lm_head, embed=embed, max_tree_nodes=args.max_tree_nodes)
    if args.json:
        print_json(report, indent=2)
        return 0
    print(f"{report['rows']} positions along the model's own greedy answers")
    print("head  top-1   top-5   top-1 when the heads before it were right")
    for i, (t1, t5, c1) in enumerate(zip(report["top1"], report["top5"], report["conditional_top1"])):
        print(f"{i + 1:4d}  {t1:.3f}   {t5:.3f}   {c1:.3f}")
    for tree, value in report["mean_accepted_len"].items():
        if tree in report["tree_nodes"]:
            print(f"mean accepted length, {tree} tree ({report['tree_nodes'][tree]} nodes): {value:.3f}")
        else:  # chain+lookup: the chain, replaced by prompt lookup's draft wherever one is found
            print(f"mean accepted length, {tree} (prompt lookup's draft where found, else the chain): {value:.3f}")
    for cat, stats in report["per_category"].items():
        print(f"  [{cat}] rows {stats['rows']}: top-1 {stats['top1']}, accepted {stats['mean_accepted_len']}")
    for bucket, stats in report["per_context_length"].items():
        print(f"  [context {bucket} tokens] rows {stats['rows']}: top-1 {stats['top1']}, "
              f"accepted {stats['mean_accepted_len']}")
    if len(report["per_source"]) > 1:
        for name, stats in report["per_source"].items():
            print(f"  [source {name}] rows {stats['rows']}: top-1 {stats['top1']}, accepted {stats['mean_accepted_len']}")
    return 0


def add_audit_held_out_command(sub) -> None:
    p = sub.add_parser("audit-held-out", help="drop held-out prompts that the training answers hold, or nearly repeat",
                       description="Reads training and held-out answer files, removes every held-out prompt from a "
                                   "conversation the training answers hold a part of, and every near-duplicate of a "
                                   "training prompt (Jaccard similarity of 5-token shingles at or above --threshold), "
                                   "says how many of each, and writes the held-out answers that remain to --out "
                                   "(with audit.json).")
    p.add_argument("--train", required=True, help="training answer folders, separated by commas")
    p.add_argument("--held-out", required=True, help="held-out answer folders, separated by commas")
    p.add_argument("--out", default=None, help="folder for the held-out answer files that remain")
    p.add_argument("--threshold", type=float, default=None, help="Jaccard similarity that counts as a near-duplicate "
                                                                   "(default 0.5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_audit_held_out)


def cmd_audit_held_out(args) -> int:
    from dataclasses import asdict

    from vllm_mtpspec.near_duplicates import THRESHOLD
    from vllm_mtpspec_train.held_out_audit import audit_held_out, write_clean

    train = [d for d in args.train.split(",") if d]
    held_out = [d for d in args.held_out.split(",") if d]
    audit = audit_held_out(train, held_out, threshold=THRESHOLD if args.threshold is None else args.threshold)
    written = write_clean(held_out, audit, args.out, train_dirs=train) if args.out else []
    if args.json:
        print_json({**asdict(audit), "written": [str(p) for p in written]}, indent=1)
    else:
        print(audit.summary())
        for path in written:
            print(path)
    return 0
