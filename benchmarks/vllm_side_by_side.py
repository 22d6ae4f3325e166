"""vLLM output tokens per second with and without mtpspec, in one run, same prompts.

    python benchmarks/vllm_side_by_side.py [--heads DIR] [--max-tokens 64] [--num-spec 2,3]

Greedy, fp32, in-process engines built one after another; each engine is warmed up with
one short request first. Prompts: benchmarks/prompts/demo.jsonl (first 8). `ignore_eos`
keeps every method decoding the same number of tokens.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_mtpspec.cli import shipped_heads_dir
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.prompts import load_prompts_jsonl

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=None, help="heads directory (default: the shipped heads)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-spec", default="2,3", help="num_speculative_tokens values to compare")
    parser.add_argument("--batch-sizes", default="1,8")
    args = parser.parse_args()
    model = str(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    heads = args.heads or str(shipped_heads_dir())
    prompts = [p.text for p in load_prompts_jsonl(os.path.join(os.path.dirname(__file__), "prompts", "demo.jsonl"))][:8]
    common = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    methods = [("none", None)] + [(f"mtpspec-k{k}", int(k)) for k in args.num_spec.split(",")]
    baseline = {}
    for name, k in methods:
        spec = {} if k is None else {"speculative_config": {"method": "mtpspec", "model": heads, "num_speculative_tokens": k}}
        llm = LLM(model, **common, **spec)
        tok = llm.get_tokenizer()
        chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in prompts]
        llm.generate(chats[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            start, tokens = time.perf_counter(), 0
            for i in range(0, len(chats), bs):
                outs = llm.generate(chats[i:i + bs], params, use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            rate = tokens / (time.perf_counter() - start)
            baseline.setdefault(bs, rate)
            print(f"{name:12s} batch={bs:3d} {rate:7.1f} tok/s  x{rate / baseline[bs]:.2f}", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
