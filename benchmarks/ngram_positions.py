"""Where vLLM's ngram drafts, what does a draft block keep there? Teacher-forced along the
target's own greedy answers, chains of --depth, position by position.

vLLM's mean accepted length averages over the steps where a method drafted. The block drafts
at every step; ngram only where its context's last 2 to 4 tokens occurred before, which are
the easy steps (loops, copies of the request). So the two averages are over different steps.
This compares them on the same ones:

- paired: at every answer position where vLLM's own ngram proposer (the function its
  NgramProposer runs, at the bench's settings) finds a match, the tokens a step starting
  there would keep with ngram's draft and with the block's; and the block alone elsewhere;
- replayed: greedy decoding stepped through each answer by each method alone, as vLLM would:
  ngram's mean over its drafting steps (vLLM's measure) and over every step, and the block's.

The block drafts as it does in vLLM, its copy bias included (vllm_mtpspec/copy_bias.py), over
every token unless --draft-vocab heads.

    python benchmarks/ngram_positions.py vllm_mtpspec/shipped_heads/smollm2-135m-instruct \
        --shards runs/held-out-shards/held-out-sources-audited --per-source 8 \
        --json benchmarks/results/ngram_positions.json --markdown benchmarks/results/ngram_positions.md
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

from vllm_mtpspec.bench.methods import PROMPT_LOOKUP_MAX
from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.copy_bias import check_copy_bias
from vllm_mtpspec.held_out_sources import held_out_prompts
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.fit_copy_bias import AnswerRows, accepted_at, answer_rows

PROMPT_LOOKUP_MIN = 2        # the bench's ngram row (vllm_mtpspec/bench/methods.py)
NO_LENGTH_CAP = 1 << 30      # the proposer stops drafting at the model's length: no answer here reaches it


def ngram_draft(context: np.ndarray, depth: int) -> np.ndarray:
    """What vLLM's ngram proposer drafts after `context` (its newest token last)."""
    return _find_longest_matched_ngram_and_propose_tokens(context, PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX,
                                                          NO_LENGTH_CAP, depth)


def kept(draft: np.ndarray, answer: np.ndarray, r: int) -> int:
    """How many of `draft`'s tokens the answer continues with after row r."""
    accepted = 0
    while accepted < len(draft) and r + accepted + 1 < len(answer) and draft[accepted] == answer[r + accepted + 1]:
        accepted += 1
    return accepted


def positions(a: AnswerRows, biases: dict[int, float], depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per answer row r (a step may start at every row but the last): whether ngram drafts
    there, the tokens ngram's step would keep, and the block's (accepted drafts + 1 each)."""
    context = np.concatenate([a.prompt, a.answer]).astype(np.int64)
    rows = len(a.answer) - 1
    drafts, ngram, block = np.zeros(rows, bool), np.ones(rows, np.int64), np.ones(rows, np.int64)
    for r in range(rows):
        draft = ngram_draft(context[:len(a.prompt) + r + 1], depth)
        drafts[r] = len(draft) > 0
        ngram[r] += kept(draft, a.answer, r)
        block[r] += accepted_at(a, r, biases, depth)
    return drafts, ngram, block


def replay(drafts: np.ndarray, tokens: np.ndarray) -> tuple[list[int], list[bool]]:
    """Decoding by one method alone: the tokens of each step it takes from row 0, and whether
    it drafted at that step."""
    steps, drafted, r = [], [], 0
    while r < len(tokens):
        steps.append(int(tokens[r]))
        drafted.append(bool(drafts[r]))
        r += int(tokens[r])
    return steps, drafted


def mean(values) -> float | None:
    values = list(values)
    return round(float(np.mean(values)), 3) if values else None


def summary(per_answer: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict:
    drafts = np.concatenate([d for d, _, _ in per_answer])
    ngram = np.concatenate([n for _, n, _ in per_answer])
    block = np.concatenate([b for _, _, b in per_answer])
    ngram_steps, ngram_drafted, block_steps, block_where_ngram = [], [], [], []
    for d, n, b in per_answer:
        steps, drafted = replay(d, n)
        ngram_steps += steps
        ngram_drafted += drafted
        steps, where_ngram = replay(d, b)
        block_steps += steps
        block_where_ngram += where_ngram
    ngram_steps, ngram_drafted = np.array(ngram_steps), np.array(ngram_drafted)
    block_steps, block_where_ngram = np.array(block_steps), np.array(block_where_ngram)
    return {
        "positions": int(len(drafts)),
        "positions_ngram_drafts": int(drafts.sum()),
        "paired_ngram": mean(ngram[drafts]),
        "paired_block": mean(block[drafts]),
        "block_elsewhere": mean(block[~drafts]),
        "block_ahead_where_ngram_drafts": int((block[drafts] > ngram[drafts]).sum()),
        "ngram_ahead_where_ngram_drafts": int((ngram[drafts] > block[drafts]).sum()),
        "replay_ngram_drafting_steps": mean(ngram_steps[ngram_drafted]),
        "replay_ngram_every_step": mean(ngram_steps),
        "replay_block_every_step": mean(block_steps),
        "replay_block_steps_where_ngram_drafts": mean(block_steps[block_where_ngram]),
        "replay_block_other_steps": mean(block_steps[~block_where_ngram]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("heads", help="an attention draft block's heads directory (its copy bias applies)")
    parser.add_argument("--shards", required=True, help="a held-out shard folder of held-out sources' answers")
    parser.add_argument("--per-source", type=int, default=None,
                        help="only the prompts `mtpspec bench --prompts SOURCE,...` takes with this many a "
                             "source (default: every answer in --shards)")
    parser.add_argument("--depth", type=int, default=3, help="chain depth, as --num-heads in the bench (default 3)")
    parser.add_argument("--draft-vocab", choices=("full", "heads"), default="full",
                        help="the block drafts over every token (full, the default off CPUs) or its draft "
                             "vocabulary (heads)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    block = load_heads(args.heads).float().eval()
    if not block.config.kind.keeps_context:
        parser.error(f"{args.heads}: head_kind={block.config.head_kind!r}; this compares an attention draft block")
    if not 1 <= args.depth <= block.num_heads:
        parser.error(f"--depth {args.depth}: the block drafts 1..{block.num_heads} deep")
    if args.draft_vocab == "full":
        block = block.with_draft_vocab(None)
    biases = {int(n): b for n, b in check_copy_bias(block.config.copy_bias or {}).items()}
    embed, lm_head = embedding_and_lm_head(resolve_model(args.model, dtype="fp32"))
    answers = answer_rows(block, list_shards(args.shards), lm_head, embed)
    if args.per_source is not None:
        chosen = {p.id for p in held_out_prompts(sorted({a.category for a in answers}), per_source=args.per_source)}
        answers = [a for a in answers if a.id in chosen]
        if len(answers) != len(chosen):
            parser.error(f"--shards {args.shards} holds {len(answers)} of the {len(chosen)} prompts the bench "
                         f"takes with --per-source {args.per_source}: build it from those prompts' answers")
    by_source = defaultdict(list)
    for a in answers:
        by_source[a.category].append(positions(a, biases, args.depth))
    results = {"all": summary([p for ps in by_source.values() for p in ps]),
               **{source: summary(ps) for source, ps in sorted(by_source.items())}}

    run = stamp()
    header = ("| source | positions | where ngram drafts | ngram there | block there | block elsewhere "
              "| ngram alone: drafting steps (vLLM's measure) | every step | block alone: every step |\n"
              "|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {'**all**' if source == 'all' else source} | {s['positions']:,} | {s['positions_ngram_drafts']:,} "
             f"| {s['paired_ngram']} | {s['paired_block']} | {s['block_elsewhere']} "
             f"| {s['replay_ngram_drafting_steps']} | {s['replay_ngram_every_step']} "
             f"| {s['replay_block_every_step']} |" for source, s in results.items()]
    table = (f"{args.heads} ({args.draft_vocab} vocabulary, copy bias {biases or 'none'}), chains of {args.depth}, "
             f"{len(answers)} answers; {describe(run)}\n\n`{run['command']}`\n\n"
             f"Tokens a step (accepted drafts + 1), teacher-forced along the target's greedy answers:\n\n"
             f"{header}\n" + "\n".join(lines))
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stamp": run, "heads": args.heads, "draft_vocab": args.draft_vocab,
                                               "copy_bias": biases, "depth": args.depth, "results": results},
                                              separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
