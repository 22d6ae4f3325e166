"""Greedy answers of `mtpspec serve` under a mixed load, token for token against vLLM alone.

Starts both servers on SmolLM2-135M-Instruct (fp32, the shipped drafter on the mtpspec one),
sends each the same mixed load (vllm_mtpspec/bench/mixed_load.py: chat and completions,
greedy and sampled, streamed and not, prompts up to the edge of max_model_len, stop
strings, n = 2, requests that take the fallback path), and compares every greedy answer
with the plain server's. Written: how many were greedy, identical, ties (the plain model
puts the two tokens where the answers part within --tie-gap in logprob) and differences,
each tie and difference by request, and the drafts the mtpspec server sent and kept.

    python benchmarks/serve_under_load.py --json benchmarks/results/serve_under_load.json \\
        --markdown benchmarks/results/serve_under_load.md
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from vllm_mtpspec.bench.mixed_load import (
    TIE_LOGPROB_GAP,
    compare_greedy,
    refused_with_speculation,
    request_mix,
    send_all,
    server_args,
)
from vllm_mtpspec.bench.prompts import sharegpt_held_out_prompts
from vllm_mtpspec.bench.servers import running_server
from vllm_mtpspec.bench.stamp import describe, stamp
from vllm_mtpspec.models import fetch_model
from vllm_mtpspec.shipped import shipped_heads_dir

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def markdown(result: dict) -> str:
    found, s = result["greedy"], result["stamp"]
    lines = ["## Greedy answers under a mixed load: `mtpspec serve` against vLLM alone", "",
             f"{describe(s)}", "", f"`{s['command']}`", "",
             f"{result['requests']} requests, up to {result['in_flight']} in flight "
             f"(seed {result['seed']}, max_model_len {result['max_model_len']}, "
             f"{result['num_speculative_tokens']} draft tokens); answered with status 200: "
             f"mtpspec {result['answered']['mtpspec']}, vLLM alone {result['answered']['plain']} "
             f"(logit bias is refused with any speculative method: {result['refused_with_speculation']} requests).",
             "", "| greedy requests | identical | ties (gap < %g) | differences |" % result["tie_gap"],
             "|---|---|---|---|",
             f"| {found['greedy']} | {found['identical']} | {len(found['ties'])} | {len(found['differences'])} |", ""]
    for kind in ("ties", "differences"):
        for item in found[kind]:
            gap = "-" if item["logprob_gap"] is None else f"{item['logprob_gap']:.1e}"
            why = f", {item['why']}" if item.get("why") else ""
            lines.append(f"- {kind[:-1] if kind == 'ties' else 'difference'}: request {item['request']}, "
                         f"token {item['token']}, logprob gap {gap}{why}")
    spec = result["spec_decode"]
    lines += ["", f"mtpspec's drafts over the load (vLLM's counters): {spec['num_drafts']:.0f} drafted steps of a "
              f"request, {spec['num_draft_tokens']:.0f} draft tokens, {spec['num_accepted_tokens']:.0f} accepted.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160, help="requests in the mix, sent to both servers")
    parser.add_argument("--in-flight", type=int, default=64, help="requests sent at once")
    parser.add_argument("--seed", type=int, default=0, help="the mix's random seed")
    parser.add_argument("--max-model-len", type=int, default=768, help="both servers'; the longest prompts reach it")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="the mtpspec server's chain length")
    parser.add_argument("--tie-gap", type=float, default=TIE_LOGPROB_GAP,
                        help="logprob gap below which a parting is a tie (default %(default)g)")
    parser.add_argument("--json", required=True, help="where to write the result")
    parser.add_argument("--markdown", default=None, help="where to write it as a table too")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = [p.text for p in sharegpt_held_out_prompts()]
    mix = request_mix(texts, tokenizer, random.Random(args.seed), num_requests=args.requests,
                      max_model_len=args.max_model_len)
    plain_args = server_args(args.max_model_len)
    logs = Path(tempfile.mkdtemp(prefix="serve-under-load-"))
    with running_server("plain", model, None, logs / "plain.log", plain_args) as plain, \
            running_server("mtpspec", model, str(shipped_heads_dir()), logs / "mtpspec.log",
                           [*plain_args, "--num-speculative-tokens", str(args.num_speculative_tokens)]) as spec:
        before = spec.metrics()
        results = {s.label: send_all(s.base_url, model, mix, args.in_flight) for s in (plain, spec)}
        after = spec.metrics()
        found = compare_greedy(mix, results["mtpspec"], results["plain"], plain_url=plain.base_url, model=model,
                               tie_gap=args.tie_gap)
    result = {
        "stamp": stamp(), "requests": len(mix), "in_flight": args.in_flight, "seed": args.seed,
        "max_model_len": args.max_model_len, "num_speculative_tokens": args.num_speculative_tokens,
        "tie_gap": args.tie_gap, "greedy": found,
        "answered": {label: sum(r.get("status") == 200 for r in replies) for label, replies in results.items()},
        "refused_with_speculation": sum(refused_with_speculation(q["body"]) is not None for q in mix),
        "spec_decode": {k: after.get(f"vllm:spec_decode_{k}_total", 0.0) - before.get(f"vllm:spec_decode_{k}_total", 0.0)
                        for k in COUNTERS},
    }
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
