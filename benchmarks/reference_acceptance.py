"""Mean accepted length of a heads directory on the bench's prompts, decoded by the reference
decoder (transformers, no vLLM): what the heads keep on these prompts, to set beside what
`mtpspec bench` measures through vLLM. Where the two agree, a gap between the bench and
the teacher-forced held-out scores lies in the prompts, not in the serving path.

    python benchmarks/reference_acceptance.py --heads vllm_mtpspec/shipped_heads/smollm2-135m-instruct \
        --json benchmarks/results/reference_acceptance_v6.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_mtpspec.bench.command import cut_prompt
from vllm_mtpspec.bench.prompts import load_bench_prompts
from vllm_mtpspec.bench.stamp import stamp
from vllm_mtpspec.config import SpecOptions
from vllm_mtpspec.drafter import drafter_for
from vllm_mtpspec.prompts import apply_chat_template
from vllm_mtpspec.reference import ReferenceDecoder
from vllm_mtpspec.target import load_heads_for, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="a heads directory")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="humaneval,sharegpt-held-out", help="as `mtpspec bench --prompts`")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=4, help="the chain's length")
    parser.add_argument("--prompt-lookup", choices=("on", "off"), default="off")
    parser.add_argument("--min-path-prob", type=float, default=SpecOptions.min_path_prob,
                        help="where a chain stops (as the option; 0: every chain is drafted whole)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512,
                        help="longer prompts are cut as `mtpspec bench` cuts them (same flag, same default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="where to write the per-prompt rows and the means")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype="fp32")
    heads = load_heads_for(target, args.heads)
    options = SpecOptions(tree="chain", num_speculative_tokens=args.num_heads, min_path_prob=args.min_path_prob,
                          prompt_lookup_max=4 if args.prompt_lookup == "on" else 0)
    decoder = ReferenceDecoder(target.model, drafter_for(heads, target.model), options)
    rows = []
    prompts = [cut_prompt(p, target.tokenizer, args.max_prompt_tokens)
               for p in load_bench_prompts(args.prompts, args.num_prompts)]
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        # A later turn with the conversation before it, as the bench sends it.
        text = apply_chat_template(target.tokenizer, prompt.text, prompt.history)
        ids = target.tokenizer(text, add_special_tokens=False).input_ids
        with torch.inference_mode():
            result = decoder.decode(ids, max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids)
        rows.append({"id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
                     "steps": len(result.steps), "emitted": sum(s.accepted_len for s in result.steps)})

    def mean(subset):
        return round(sum(r["emitted"] for r in subset) / max(sum(r["steps"] for r in subset), 1), 3)

    summary = {"heads": args.heads, "chain": args.num_heads, "prompt_lookup": args.prompt_lookup,
               "min_path_prob": args.min_path_prob, "stamp": stamp(sys.argv),
               "mean_accepted_length": mean(rows),
               "by_category": {c: mean([r for r in rows if r["category"] == c]) for c in sorted({r["category"] for r in rows})}}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
