"""Seconds per training step of the heads (forward, backward, optimizer) at real shapes:
SmolLM2-135M-Instruct's hidden size and vocabulary, four heads, random batches.

    python benchmarks/train_step_cost.py --threads 2 --batch-size 256
"""
import argparse
import time

import torch

from vllm_mtpspec.heads_init import init_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.target import load_target
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.modules import PosthocModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct", dtype="fp32")
    target = load_target(str(model_dir))
    embed, lm_head = embedding_and_lm_head(model_dir)
    d, vocab, b = target.model.config.hidden_size, target.model.config.vocab_size, args.batch_size
    g = torch.Generator().manual_seed(0)
    batch = {"hidden": torch.randn(b, d, generator=g).half().numpy(),
             "token": torch.randint(0, vocab, (b,), generator=g).numpy(),
             "targets": torch.randint(0, vocab, (b, 4), generator=g).numpy(),
             "teacher_ids": torch.randint(0, vocab, (b, 4, 8), generator=g).int().numpy(),
             "teacher_logprobs": torch.randn(b, 4, 8, generator=g).numpy()}
    for tied in (True, False):
        heads = init_heads(target.model, model_dir, num_heads=4, tied=tied, head_input="hidden+token", init_std=0.0)
        module = PosthocModule(heads, lm_head=lm_head, embed=embed, num_negatives=2048, kl_weight=1.0)
        for fused in (False, True):
            optimizer = torch.optim.AdamW(module.trainable_parameters(), lr=1e-3, fused=fused)
            times = []
            for _ in range(args.steps + 1):
                t0 = time.perf_counter()
                loss, _ = module(batch, g)
                t1 = time.perf_counter()
                optimizer.zero_grad()
                loss.backward()
                t2 = time.perf_counter()
                optimizer.step()
                times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
            fwd, bwd, opt = (sum(x) / args.steps for x in zip(*times[1:]))  # the first step warms up
            print(f"{'tied' if tied else 'untied'} fused={fused}: forward {fwd:.3f} s, backward {bwd:.3f} s, "
                  f"optimizer {opt:.3f} s, step {fwd + bwd + opt:.3f} s")


if __name__ == "__main__":
    main()
