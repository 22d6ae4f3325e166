"""Cost of one target forward over n query tokens with a KV cache, relative to n = 1.

This is the budget a draft tree must fit in: if verifying 16 nodes costs about one
decode step, a tree of 16 nodes is almost free. Timed with transformers on the CPU
(the reference path); each n alternates with n = 1 so that a noisy machine skews both.

    python benchmarks/verify_cost.py --model smollm2-135m-instruct --dtype bf16 --threads 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_mtpspec.target import load_target


def time_forward(model, cache_len: int, n: int, repeats: int) -> float:
    from transformers import DynamicCache

    device = model.device
    prefix = torch.randint(0, model.config.vocab_size, (1, cache_len), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model.model(input_ids=prefix, past_key_values=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            query = torch.randint(0, model.config.vocab_size, (1, n), device=device)
            positions = torch.arange(cache_len, cache_len + n, device=device)[None]
            start = time.perf_counter()
            hidden = model.model(input_ids=query, position_ids=positions, past_key_values=cache, use_cache=True).last_hidden_state
            model.get_output_embeddings()(hidden)
            times.append(time.perf_counter() - start)
            for layer in cache.layers:  # drop the query's entries again
                layer.keys, layer.values = layer.keys[..., :cache_len, :], layer.values[..., :cache_len, :]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-len", type=int, default=128)
    parser.add_argument("--sizes", default="1,2,4,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(args.model, dtype=args.dtype).model
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        base = time_forward(model, args.cache_len, 1, args.repeats)
        cost = time_forward(model, args.cache_len, n, args.repeats)
        rows.append({"n": n, "ms": round(cost * 1e3, 2), "ms_n1": round(base * 1e3, 2), "ratio": round(cost / base, 3)})
        print(f"n={n:3d}  {cost * 1e3:7.2f} ms   n=1: {base * 1e3:6.2f} ms   ratio {cost / base:5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
