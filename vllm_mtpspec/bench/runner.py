"""Run every method on the same prompts, batch size by batch size, taking turns.

For each batch size and temperature, every method decodes the same batches; the order of
methods rotates from round to round. Before a setting's first timed batch, every engine
decodes that setting's first batch once, untimed: the figures are an engine's steady
state, as a server that has run a while sees it, where the draft-size planner has already
measured what this kind of batch costs (it learns per batch size and for greedy and
sampled batches apart). Engines without speculation get the same warm-up. Every request
decodes exactly max_new_tokens (ignore_eos), so tokens per second compare like for like;
the demo lets requests stop at their end of sequence instead (greedy outputs are
identical, so lengths agree). Batch size 1 runs prompt by prompt, which also gives
per-category figures.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vllm_mtpspec.bench.methods import Method
from vllm_mtpspec.bench.worker import Batch, EngineWorker
from vllm_mtpspec.prompts import Prompt


@dataclass
class Tally:
    """What one method did at one batch size and temperature."""

    tokens: int = 0
    seconds: float = 0.0
    counters: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    by_category: dict = field(default_factory=dict)  # batch size 1 only

    def add(self, reply: dict, category: str | None = None) -> None:
        tokens = sum(len(t) for t in reply["token_ids"])
        self.tokens += tokens
        self.seconds += reply["seconds"]
        self.outputs.extend(reply["token_ids"])
        _accumulate(self.counters, reply["counters"])
        if category is not None:
            slot = self.by_category.setdefault(category, {"tokens": 0, "seconds": 0.0, "counters": {}})
            slot["tokens"] += tokens
            slot["seconds"] += reply["seconds"]
            _accumulate(slot["counters"], reply["counters"])


def _accumulate(total: dict, delta: dict) -> None:
    for key, value in delta.items():
        if isinstance(value, list):
            old = total.get(key) or [0] * len(value)
            total[key] = [a + b for a, b in zip(old, value)]
        else:
            total[key] = total.get(key, 0) + value


def batches_for(prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """Batches of exactly batch_size prompts; the prompt list is repeated when it is shorter."""
    if batch_size == 1:
        return [[p] for p in prompts]
    needed = max(batch_size, len(prompts))
    needed = -(-needed // batch_size) * batch_size
    pool = [prompts[i % len(prompts)] for i in range(needed)]
    return [pool[i: i + batch_size] for i in range(0, needed, batch_size)]


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """The KV cache bytes one token takes in every layer of the model folder's config."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    element = {"fp32": 4, "bf16": 2}[dtype]  # the KV cache is kept in the model's dtype
    return 2 * config["num_hidden_layers"] * heads * head_dim * element


def engine_settings(max_batch: int, max_prompt_tokens: int, max_new_tokens: int, bytes_per_token: int,
                    dtype: str = "fp32") -> dict:
    tokens = max_batch * (max_prompt_tokens + max_new_tokens + 64)
    return dict(dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                max_model_len=max_prompt_tokens + max_new_tokens + 64, enforce_eager=True,
                max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_prompt_tokens + 64),
                kv_cache_memory_bytes=int(tokens * bytes_per_token * 1.3) + (32 << 20),
                disable_log_stats=False, seed=0)


def run_benchmark(methods: list[Method], prompts: list[Prompt], *, model: str, batch_sizes: list[int],
                  temperatures: list[float], max_new_tokens: int, rounds: int, engine: dict, log_dir: Path,
                  ignore_eos: bool = True) -> dict[tuple[str, int, float], Tally]:
    runnable = [m for m in methods if m.unavailable is None]
    workers: dict[str, EngineWorker] = {}
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for method in tqdm(runnable, desc="starting engines", unit="engine"):
            worker = EngineWorker(method.name, model, engine, method.speculative_config,
                                  str(log_dir / f"{_slug(method.name)}.log"))
            error = worker.wait_ready()
            if error:
                worker.close()
                method.unavailable = f"engine failed to start: {error.splitlines()[0][:300]}"
                continue
            worker.generate(Batch([prompts[0]], 0.0, 8))  # warm-up
            workers[method.name] = worker
        tallies: dict[tuple[str, int, float], Tally] = {}
        active = [m for m in runnable if m.name in workers]
        plan = [(b, t, r) for b in batch_sizes for t in temperatures for r in range(rounds)]
        total = sum(len(batches_for(prompts, b)) + (r == 0) for b, _, r in plan) * len(active)
        with tqdm(total=total, desc="benchmark", unit="batch") as bar:
            for batch_size, temperature, round_index in plan:
                order = active[round_index % len(active):] + active[: round_index % len(active)]
                groups = batches_for(prompts, batch_size)
                if round_index == 0:
                    for method in order:
                        bar.set_postfix(method=method.name, bs=batch_size, T=temperature, warm_up=True)
                        workers[method.name].generate(Batch(list(groups[0]), temperature, max_new_tokens, ignore_eos))
                        bar.update()
                for group in groups:
                    for method in order:
                        bar.set_postfix(method=method.name, bs=batch_size, T=temperature)
                        reply = workers[method.name].generate(
                            Batch(list(group), temperature, max_new_tokens, ignore_eos))
                        tally = tallies.setdefault((method.name, batch_size, temperature), Tally())
                        tally.add(reply, group[0].category if batch_size == 1 else None)
                        bar.update()
        return tallies
    finally:
        for worker in workers.values():
            worker.close()


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def save_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
