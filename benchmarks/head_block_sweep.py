"""Head block shapes side by side at one training budget: which block to ship.

Trains each variant in this process (no Ray: the same loss, optimiser and schedule as the
training job, random batches of the first SHARDS train shards) and scores it on the
held-out shards with the job's own evaluation. Variants:

- base: Medusa's single residual layer, z = h + SiLU(W u + b) (heads v1-v3);
- deep: base, then a second residual layer per head, z + SiLU(V_i z + c_i);
- wide: a hidden layer of width MULT x d per head, z = h + D_i SiLU(W_i u + b_i)
  (HeadsConfig.mlp_size; MULT from the environment, default 2).

    for v in base deep wide; do python benchmarks/head_block_sweep.py $v 30 2000; done
    MULT=4 python benchmarks/head_block_sweep.py wide 30 2000

Each run prints its loss every 250 steps and one `RESULT` line (held-out top-1 / top-5 per
head, mean accepted length with the chain and consensus trees).
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.config import HeadsConfig
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.shards import list_shards
from vllm_mtpspec.weights import embedding_and_lm_head
from vllm_mtpspec_train.evaluate import evaluate_heads
from vllm_mtpspec_train.examples import load_examples
from vllm_mtpspec_train.losses import mtp_losses

SHIPPED = "vllm_mtpspec/shipped_heads/smollm2-135m-instruct"
K, D = 4, 576


class SweepHeads(MTPHeads):
    """The variants as experiments; `wide` is what HeadsConfig.mlp_size builds."""

    def __init__(self, config: HeadsConfig, mode: str) -> None:
        super().__init__(config)
        self.mode = mode
        if mode == "deep":
            self.w2 = nn.Parameter(torch.zeros(K, D, D))
            self.b2 = nn.Parameter(torch.zeros(K, D))
            nn.init.normal_(self.w2, std=0.02)
        elif mode == "wide":
            self.m = int(os.environ.get("MULT", "2")) * D
            self.block = nn.Linear(2 * D, K * self.m)
            self.w_down = nn.Parameter(torch.zeros(K, self.m, D))

    def hidden(self, h, token_embeds=None):
        u = torch.cat([h, token_embeds.to(h.dtype) * self.config.embed_scale], dim=-1)
        if self.mode == "wide":
            a = F.silu(self.block(u)).view(*h.shape[:-1], K, self.m)
            return h.unsqueeze(-2) + torch.einsum("...km,kmd->...kd", a, self.w_down)
        z = h.unsqueeze(-2) + F.silu(self.block(u)).view(*h.shape[:-1], K, D)
        if self.mode == "deep":
            z = z + F.silu(torch.einsum("...kd,kde->...ke", z, self.w2) + self.b2)
        return z


def main() -> None:
    variant, num_shards, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    embed, lm_head = embedding_and_lm_head(resolve_model("smollm2-135m-instruct", dtype="fp32"))
    shipped = load_heads(SHIPPED)  # its config: the model's fingerprint, embed scale, tree statistics
    config = HeadsConfig.from_dict({**shipped.config.to_dict(), "mlp_size": 0, "temperatures": [1.0] * K})
    heads = MTPHeads(config) if variant == "base" else SweepHeads(config, variant)
    print(variant, "params", sum(p.numel() for p in heads.parameters()), flush=True)
    examples = load_examples(list_shards("runs/sharegpt-sd/train")[:num_shards], K)
    n = len(examples["token"])
    print("rows", n, flush=True)
    hidden = torch.from_numpy(examples["hidden"])
    token = torch.from_numpy(examples["token"]).long()
    targets = torch.from_numpy(examples["targets"])
    teacher_ids = torch.from_numpy(examples["teacher_ids"])
    teacher_lp = torch.from_numpy(examples["teacher_logprobs"])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3, weight_decay=0.0)
    # The training job's schedule: 50 warm-up steps, then linear decay to 5%.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    generator = torch.Generator().manual_seed(0)
    started, running = time.time(), 0.0
    for step in range(steps):
        idx = torch.randint(0, n, (256,), generator=generator)
        head_hidden = heads.hidden(hidden[idx].float(), embed[token[idx]])
        losses = mtp_losses(head_hidden, lm_head, targets[idx], teacher_ids[idx], teacher_lp[idx],
                            num_negatives=2048, generator=generator)
        optimizer.zero_grad()
        losses.total.backward()
        optimizer.step()
        schedule.step()
        running = 0.98 * running + 0.02 * losses.total.item() if step else losses.total.item()
        if step % 250 == 0 or step == steps - 1:
            print(step, round(running, 3), [round(c, 3) for c in losses.ce], round(time.time() - started), flush=True)
    heads.config.rank_accuracy = shipped.config.rank_accuracy  # one consensus tree shape for every variant
    scores = evaluate_heads(heads, list_shards("runs/sharegpt-sd/held-out"), lm_head=lm_head, embed=embed,
                            prompt_lookup=None)
    print("RESULT", variant, num_shards, steps, json.dumps({
        "top1": scores["top1"], "top5": scores["top5"], "acc": scores["mean_accepted_len"], "rows": scores["rows"]}))


if __name__ == "__main__":
    main()
