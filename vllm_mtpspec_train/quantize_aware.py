"""The INT2 copy of trained heads: round-to-nearest, calibrated (search, GPTQ), or
quantization-aware fine-tuning from GPTQ's codes (`quantize_aware_steps`).

Fine-tuning starts every matrix at GPTQ's solution (its weights set to their dequantized
codes, its ranges learnable) and takes a few hundred steps of the training loss with the
weights seen through their 2-bit codes (quant/fake_int2.py), on the training shards.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vllm_mtpspec.calibration_data import statistics_from_rows
from vllm_mtpspec.heads import MTPHeads
from vllm_mtpspec.heads_quant import head_linears, quantize_heads
from vllm_mtpspec.quant import dequantize_int2
from vllm_mtpspec.quant.fake_int2 import attach, pack
from vllm_mtpspec.sequential_heads import example_chain_tokens
from vllm_mtpspec_train.examples import load_examples

logger = logging.getLogger("mtpspec.train")


def statistics_from_examples(heads: MTPHeads, examples: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                             max_rows: int = 32768):
    rows = min(max_rows, len(examples["token"]))
    hidden = torch.as_tensor(examples["hidden"][:rows]).float()
    tokens = torch.as_tensor(examples["token"][:rows])
    if heads.config.kind.reads_drafted_tokens:  # each depth's token, from the rows' own answers
        tokens = example_chain_tokens(tokens, torch.as_tensor(examples["targets"][:rows]), heads.num_heads)
    chunks = ((hidden[i:i + 1024], tokens[i:i + 1024]) for i in range(0, rows, 1024))
    return statistics_from_rows(heads, chunks, embed=embed, lm_head=lm_head), rows


def quantize_aware(heads: MTPHeads, examples: dict, *, lm_head: torch.Tensor, embed: torch.Tensor, steps: int,
                   group_size: int = 64, lr: float = 1e-5, ranges_lr_scale: float = 0.1, batch_size: int = 256,
                   num_negatives: int = 2048, kl_weight: float = 1.0, seed: int = 0, statistics=None) -> MTPHeads:
    """INT2 heads fine-tuned for `steps` steps with fake-quantized weights (examples:
    vllm_mtpspec_train.examples.load_examples columns). Adam moves every parameter by about lr per
    step whatever its size, and a group's scale is a few times smaller than its weights:
    the ranges learn at lr * ranges_lr_scale, so neither jumps past a code's width."""
    from vllm_mtpspec_train.modules import PosthocModule

    heads = heads.float()
    if statistics is None:
        statistics, _ = statistics_from_examples(heads, examples, embed, lm_head)
    start = quantize_heads(heads, method="gptq", group_size=group_size, statistics=statistics)
    student = copy.deepcopy(heads)
    for linear, int2_linear in zip(head_linears(student).values(), head_linears(start).values()):
        with torch.no_grad():
            linear.weight.copy_(dequantize_int2(int2_linear.qweight))
        attach(linear, int2_linear.qweight)
    module = PosthocModule(student, lm_head=lm_head, embed=embed, num_negatives=num_negatives, kl_weight=kl_weight)
    ranges = [p for name, p in student.named_parameters() if name.endswith((".scale", ".low"))]
    others = [p for p in module.trainable_parameters() if all(p is not r for r in ranges)]
    optimizer = torch.optim.Adam([{"params": others, "lr": lr}, {"params": ranges, "lr": lr * ranges_lr_scale}])
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    n = len(examples["token"])
    bar = tqdm(range(steps), desc="quantization-aware steps", unit="step")
    for _ in bar:
        rows = rng.choice(n, size=min(batch_size, n), replace=False)
        loss, metrics = module({key: value[rows] for key, value in examples.items()
                                if key in ("hidden", "token", "targets", "teacher_ids", "teacher_logprobs")},
                               generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
    with torch.no_grad():  # quantized() hands over these very (fake-quantized) matrices
        return student.quantized(group_size=group_size, int2=pack, method="qat",
                                 calibration=f"GPTQ, then {steps} quantization-aware steps on {n} rows")


def int2_copy(heads: MTPHeads, config, train_shards: list[Path], *, lm_head: torch.Tensor,
              embed: torch.Tensor) -> MTPHeads:
    """The training config's INT2 copy: int2_method (an attention draft block's calibrated
    on whole answers with their prompt rows), and quantize_aware_steps on top (MLP heads)."""
    if not config.quantize_aware_steps and config.int2_method == "rtn":
        return heads.quantized(group_size=config.int2_group_size)

    files = train_shards[: config.int2_calibration_shards]
    if heads.config.kind.keeps_context:  # whole answers with their prompt rows (no QAT: TrainConfig)
        from vllm_mtpspec.calibration_data import block_statistics_from_shards

        statistics, rows = block_statistics_from_shards(heads.float(), files, 32768, embed=embed, read=[])
        return quantize_heads(heads.float(), method=config.int2_method, group_size=config.int2_group_size,
                              statistics=statistics,
                              calibration=f"{rows} answer rows (with their context) of {len(files)} training shards")
    examples = load_examples(files, heads.num_heads)
    statistics, rows = statistics_from_examples(heads.float(), examples, embed, lm_head)
    described = f"{rows} rows of {len(files)} training shards"
    if config.quantize_aware_steps:
        logger.info("INT2 copy: GPTQ, then %d quantization-aware steps", config.quantize_aware_steps)
        return quantize_aware(heads, examples, lm_head=lm_head, embed=embed, steps=config.quantize_aware_steps,
                              group_size=config.int2_group_size, num_negatives=config.num_negatives,
                              kl_weight=config.kl_weight, seed=config.seed, statistics=statistics)
    return quantize_heads(heads.float(), method=config.int2_method, group_size=config.int2_group_size,
                          statistics=statistics, calibration=described)
