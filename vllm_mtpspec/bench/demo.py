"""The main job: a known model (SmolLM2-135M-Instruct by default) in vLLM, alone and with
its drafter (as a chain, as a tree, and as a chain with prompt lookup), on a handful of
prompts, with a small side-by-side table."""
from __future__ import annotations

import tempfile
from pathlib import Path

DEMO_PROMPTS = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "prompts" / "demo.jsonl"


def run_demo(*, model_name: str, heads_dir: str, tree: str | None, num_heads: int, max_tree_nodes: int,
             max_new_tokens: int, limit: int) -> int:
    from transformers import AutoTokenizer

    from vllm_mtpspec.bench.methods import PROMPT_LOOKUP_MAX, Method
    from vllm_mtpspec.bench.report import summarize
    from vllm_mtpspec.bench.runner import engine_settings, kv_bytes_per_token, run_benchmark
    from vllm_mtpspec.checkpoint import read_heads_config
    from vllm_mtpspec.model_profile import model_profile
    from vllm_mtpspec.models import fetch_model
    from vllm_mtpspec.prompts import load_prompts_jsonl

    tree = tree or read_heads_config(heads_dir).kind.default_tree

    model = str(fetch_model(model_name, dtype="fp32"))
    prompts = load_prompts_jsonl(DEMO_PROMPTS, limit=limit)
    mtpspec = {"method": "mtpspec", "model": heads_dir, "num_speculative_tokens": num_heads}
    heads_alone = {**mtpspec, "prompt_lookup_max": 0}
    methods = [
        Method("none", "none", None),
        Method(f"mtpspec chain, {num_heads} heads alone", "mtpspec-chain", {**heads_alone, "tree": "chain"}),
        Method(f"mtpspec {tree} tree, up to {max_tree_nodes} nodes", "mtpspec-tree",
               {**heads_alone, "tree": tree, "max_tree_nodes": max_tree_nodes}),
        Method("mtpspec default: chain + prompt lookup", "mtpspec-chain",
               {**mtpspec, "tree": "chain", "prompt_lookup_max": PROMPT_LOOKUP_MAX}),
    ]
    windows = sorted({w for w in model_profile(model).layer_windows if w})
    if windows:  # the engine would refuse a tree at start-up (hooks.tree_attention_blocker)
        methods = [m for m in methods if m.family != "mtpspec-tree"]
        print(f"no tree row: trees are not verified on sliding-window layers (this model's window: {windows[0]} "
              "tokens), so its drafts are chains")
    print(f"model: {model}\nheads: {heads_dir}\nstarting {len(methods)} vLLM engines (CPU, fp32) ...")
    engine = engine_settings(1, 512, max_new_tokens, bytes_per_token=kv_bytes_per_token(model, "fp32"))
    with tempfile.TemporaryDirectory() as logs:
        tallies = run_benchmark(methods, prompts, model=model, batch_sizes=[1], temperatures=[0.0],
                                max_new_tokens=max_new_tokens, rounds=1, engine=engine, log_dir=Path(logs),
                                ignore_eos=False)
    rows = {r["method"]: r for r in summarize(methods, tallies)}
    tokenizer = AutoTokenizer.from_pretrained(model)
    alone = tallies[("none", 1, 0.0)]
    for prompt, output in zip(prompts, alone.outputs):
        print(f"\n--- [{prompt.category}] {prompt.text}\n{tokenizer.decode(output, skip_special_tokens=True).strip()}")
    print(f"\n{len(prompts)} prompts, greedy, batch size 1, up to {max_new_tokens} new tokens\n")
    width = max(len(m.name) for m in methods) + 2
    print(f"{'':<{width}} {'tok/s':>7} {'speed-up':>9} {'mean accepted':>14} {'identical output':>17}")
    ok = True
    for method in methods:
        label = "vLLM alone" if method.name == "none" else method.name
        row = rows.get(method.name)
        if row is None:
            print(f"{label:<{width}} did not run: {method.unavailable}")
            ok = False
            continue
        identical = row["identical_greedy_output"]
        ok &= identical is not False
        print(f"{label:<{width}} {row['tokens_per_s']:>7.1f} {_x(row['speedup']):>9} "
              f"{_f(row['mean_accepted_length']):>14} {('-' if identical is None else 'yes' if identical else 'NO'):>17}")
    return 0 if ok else 1


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"
