"""Where an attention draft block's time goes inside a real vLLM engine at a large batch:
its caches' upkeep (BlockContexts.update), its drafts (chain_probs, with any rows held back
for them), the whole proposal, each against the wall time of generating; what the planner
sent of the chains the block offered; and every pass through the block (extend_many) by
the rows it was given and the rows it would compute padded to the longest request's.

    python benchmarks/block_upkeep.py --heads runs/block-v2-layers-dv8k [--batch 64] [--temperature 0]

All prompts (HumanEval and held-out ShareGPT, interleaved) go in one LLM.generate call
after a warm-up, with the bench's engine settings (`mtpspec bench`), prompt lookup on,
chains of 4, the default draft-size rule. It reads the proposer's modules by name, so the
same script times older commits' code (run it from their checkout).
"""
import argparse
import collections
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, to be timed
sys.path.insert(0, ".")

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--heads", required=True, help="an attention draft block's directory")
parser.add_argument("--batch", type=int, default=64, help="prompts generated together")
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--passes", type=int, default=12, help="the slowest passes through the block to list")
args = parser.parse_args()

from vllm import LLM, SamplingParams  # noqa: E402

import vllm_mtpspec.draft_block as draft_block  # noqa: E402
import vllm_mtpspec.draft_planner as draft_planner  # noqa: E402
import vllm_mtpspec.vllm.block_context as block_context  # noqa: E402
import vllm_mtpspec.vllm.proposer as proposer  # noqa: E402
from vllm_mtpspec.bench.prompts import load_bench_prompts  # noqa: E402
from vllm_mtpspec.bench.runner import engine_settings  # noqa: E402
from vllm_mtpspec.models import resolve_model  # noqa: E402
from vllm_mtpspec.prompts import apply_chat_template  # noqa: E402

seconds, calls = collections.defaultdict(float), collections.Counter()


def timed(cls, name: str) -> None:
    original = getattr(cls, name)

    def wrapper(*a, **k):
        started = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            seconds[name] += time.perf_counter() - started
            calls[name] += 1
    setattr(cls, name, wrapper)


for cls, name in ((block_context.BlockContexts, "update"), (block_context.BlockContexts, "chain_probs"),
                  (proposer.MTPSpecProposer, "propose")):
    timed(cls, name)
passes = []  # (requests, rows, longest request's rows, seconds)
extend_many = draft_block.DraftBlock.extend_many


def recorded_extend(self, caches, features, *a, **k):
    started = time.perf_counter()
    try:
        return extend_many(self, caches, features, *a, **k)
    finally:
        passes.append((len(caches), sum(f.shape[0] for f in features), max(f.shape[0] for f in features),
                       time.perf_counter() - started))


draft_block.DraftBlock.extend_many = recorded_extend
sent, offered = collections.Counter(), collections.Counter()
plan = draft_planner.DraftPlanner.plan


def recorded_plan(self, req_ids, candidates, **k):
    lengths = plan(self, req_ids, candidates, **k)
    for candidate, n in zip(candidates, lengths):
        if candidate is not None and candidate.source == "heads":
            sent[n] += 1
            offered[candidate.length] += 1
    return lengths


draft_planner.DraftPlanner.plan = recorded_plan
model = str(resolve_model("smollm2-135m-instruct", dtype="fp32"))
prompts = load_bench_prompts("humaneval,sharegpt-held-out", args.batch)
kv_bytes_per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers, K and V, KV heads, head size, fp32
llm = LLM(model, **engine_settings(args.batch, 512, args.max_new_tokens, kv_bytes_per_token),
          speculative_config={"method": "mtpspec", "model": args.heads, "num_speculative_tokens": 4})
tokenizer = llm.get_tokenizer()
texts = [apply_chat_template(tokenizer, p.text, p.history) for p in prompts]
llm.generate(texts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
for record in (seconds, calls, sent, offered):
    record.clear()
passes.clear()
started = time.perf_counter()
llm.generate(texts, SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens, ignore_eos=True,
                                   seed=0), use_tqdm=False)
wall = time.perf_counter() - started
print(f"# python benchmarks/block_upkeep.py --heads {args.heads} --batch {args.batch} "
      f"--temperature {args.temperature}")
print(f"generating {len(texts)} prompts x {args.max_new_tokens} tokens: {wall:.2f} s")
for name in ("update", "chain_probs", "propose"):
    print(f"  {name}: {seconds[name]:.2f} s in {calls[name]} calls, {100 * seconds[name] / wall:.1f}% of the time")
print(f"chains the block offered, by length: {sorted(offered.items())}; sent, by length: {sorted(sent.items())}")
print(f"passes through the block: {len(passes)}, {sum(p[3] for p in passes):.2f} s")
for label, chosen in (("with a prompt's rows (a request with more than 8)", [p for p in passes if p[2] > 8]),
                      ("decode rows only", [p for p in passes if p[2] <= 8])):
    print(f"  {label}: {len(chosen)} passes, {sum(p[3] for p in chosen):.2f} s")
print(f"the {args.passes} slowest:")
for requests, rows, longest, took in sorted(passes, key=lambda p: -p[3])[:args.passes]:
    print(f"  {requests} requests, {rows} rows ({requests * longest} padded to the longest, {longest}): "
          f"{1e3 * took:.1f} ms")
