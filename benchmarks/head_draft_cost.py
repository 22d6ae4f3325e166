"""What one draft step of the heads costs on this CPU, by head block, at batch 1.

Times MTPHeads.hidden (the heads' own layers) and hidden + the LM-head call over the k
heads' states (what the proposer runs per step) for SmolLM2-135M's shapes (d 576, |V|
49,152, 4 tied hidden+token heads) without a hidden layer and with one of 2d and 4d.
Random weights: the cost depends on the shapes only.

    python benchmarks/head_draft_cost.py --threads 1
"""
import argparse
import time

import torch

from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.heads import MTPHeads


def mean_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d, vocab = 576, 49152
    lm_head = torch.randn(vocab, d)
    h, e = torch.randn(1, d), torch.randn(1, d)
    print("| hidden layer | parameters | heads' layers (ms) | + LM-head call (ms) |")
    print("|---|---|---|---|")
    with torch.no_grad():
        for mlp_size in (0, 2 * d, 4 * d):
            heads = MTPHeads(HeadsConfig(num_heads=4, hidden_size=d, vocab_size=vocab, head_input="hidden+token",
                                         mlp_size=mlp_size))
            layers = mean_ms(lambda: heads.hidden(h, e), args.repeats)
            step = mean_ms(lambda: heads.project(heads.hidden(h, e), lambda z: z @ lm_head.T), args.repeats)
            print(f"| {mlp_size or 'none'} | {heads.num_parameters() / 1e6:.2f}M | {layers:.2f} | {step:.2f} |")


if __name__ == "__main__":
    main()
