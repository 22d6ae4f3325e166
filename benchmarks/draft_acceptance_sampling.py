"""At temperature T > 0, which drafts does the target accept more often: the heads' top-1
token (deterministic drafts, what vLLM's rejection sampler sees from a custom proposer) or
a token sampled from the heads' own distribution with its probabilities handed over?

For one draft position with target distribution p and draft distribution q:
  deterministic draft d = argmax q:   P(accept) = p(d)
  sampled draft x ~ q (with q given): P(accept) = sum_x min(p(x), q(x))
Both are computed exactly per held-out position, with p at temperature T from the
target's recorded top-8 logprobs (renormalised over those 8: mass beyond them is left
out, which flatters both rules alike) and q = the head's temperature-calibrated softmax.

    python benchmarks/draft_acceptance_sampling.py --heads DIR --data runs/sharegpt-sd/held-out
"""
from __future__ import annotations

import argparse
import json

import torch

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.models import fetch_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.examples import shard_examples


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True)
    parser.add_argument("--data", default="runs/sharegpt-sd/held-out")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--temperatures", default="0.3,0.7,1.0")
    args = parser.parse_args()
    heads = load_heads(args.heads).float()
    embed, lm_head = embedding_and_lm_head(fetch_model("smollm2-135m-instruct", dtype="fp32"))
    ex = shard_examples(torch.load(list_shards(args.data)[0], weights_only=True), heads.num_heads)
    n = min(args.rows, len(ex["token"]))
    hidden = torch.from_numpy(ex["hidden"][:n]).float()
    tokens = torch.from_numpy(ex["token"][:n]).long()
    t_ids = torch.from_numpy(ex["teacher_ids"][:n]).long()       # [n, k, 8]
    t_lp = torch.from_numpy(ex["teacher_logprobs"][:n]).float()
    logits = torch.cat([heads(hidden[i:i + 256], token_embeds=embed[tokens[i:i + 256]] if heads.config.token_conditioned else None,
                              lm_head=lambda x: x @ lm_head.T) for i in range(0, n, 256)])  # [n, k, V]
    rows = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        for i in range(heads.num_heads):
            valid = t_ids[:, i, 0] >= 0
            p = torch.softmax(t_lp[valid, i] / temp, dim=-1)                          # [m, 8] over target top-8
            logq = torch.log_softmax(logits[valid, i] / heads.temperatures[i], dim=-1)
            q_t = torch.softmax(logq / temp, dim=-1)                                   # heads' distribution at T
            draft = logq.argmax(-1)
            match = t_ids[valid, i] == draft[:, None]
            deterministic = (p * match).sum(-1).mean().item()
            q_on_top8 = q_t.gather(-1, t_ids[valid, i].clamp_min(0))
            sampled = torch.minimum(p, q_on_top8).sum(-1).mean().item()
            rows.append({"temperature": temp, "head": i + 1, "deterministic": round(deterministic, 4),
                         "sampled_with_probs": round(sampled, 4), "positions": int(valid.sum())})
            print(f"T={temp:.1f} head {i + 1}: accept top-1 draft {deterministic:.3f}   accept sampled draft {sampled:.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
