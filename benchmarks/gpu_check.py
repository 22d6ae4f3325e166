"""The GPU path without vLLM: one script that checks and times what mtpspec runs on a GPU.

    python benchmarks/gpu_check.py --device cuda [--out benchmarks/results/gpu_check.json]

1. The tree/chain verifier (vllm/tree_sampler.py) on CUDA logits of SmolLM2's vocabulary,
   with CUDA generators for seeded requests: greedy verdicts equal the host walk, seeded
   requests repeat, sampled first tokens follow the processed distribution, the step
   synchronises with the host only where its verdicts are read (torch.cuda sync debug
   mode counts the rest), and its time per step.
2. The heads' forward (the shipped heads, SmolLM2's LM-head shape with random weights).
3. The INT2 Triton matmul and the Triton tree-attention kernel against their PyTorch paths,
   the latter also through the forward wrapper the hooks put on vLLM's GPU attention
   backends, over a cache in their layout (gpu_tree_attention.py).
4. What recomputing tree rows adds to each attention layer on those backends, at SmolLM2's
   and an 8B Llama's attention shapes (random values in real shapes).

A GPU machine here has no vLLM (its wheel cannot travel there): vLLM's
apply_top_k_top_p is replaced by a PyTorch stand-in of the same contract, and the output
says so. Everything also runs with --device cpu (kernels only under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import sys
import time
import types
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 49152  # SmolLM2


def install_top_k_top_p_stand_in() -> str:
    """vLLM's function where vLLM is installed, else a PyTorch stand-in (sort, mask)."""
    if importlib.util.find_spec("vllm") is not None:
        return "vLLM's apply_top_k_top_p"

    def apply_top_k_top_p(logits, k, p):
        if k is None and p is None:
            return logits
        ordered, order = logits.sort(dim=-1, descending=True)
        keep = torch.ones_like(ordered, dtype=torch.bool)
        if k is not None:
            keep &= torch.arange(logits.shape[-1], device=logits.device)[None] < k.long()[:, None]
        if p is not None:
            mass = ordered.softmax(-1).cumsum(-1)
            keep &= (mass - ordered.softmax(-1)) < p[:, None]
        masked = ordered.masked_fill(~keep, -math.inf)
        return torch.empty_like(logits).scatter_(-1, order, masked)

    for name in ("vllm", "vllm.v1", "vllm.v1.sample", "vllm.v1.sample.ops"):
        sys.modules.setdefault(name, types.ModuleType(name))
    module = types.ModuleType("vllm.v1.sample.ops.topk_topp_sampler")
    module.apply_top_k_top_p = apply_top_k_top_p
    sys.modules[module.__name__] = module
    return "a PyTorch stand-in for vLLM's apply_top_k_top_p (vLLM is not installed here)"


def timed(fn, device, repeat=20) -> float:
    """Median milliseconds of fn() on device."""
    fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return sorted(samples)[len(samples) // 2]


def check_verifier(device, report) -> None:
    from types import SimpleNamespace

    from vllm_mtpspec.tree import chain_tree, consensus_tree
    from vllm_mtpspec.verify import verify_greedy
    from vllm_mtpspec.vllm.tree_sampler import verify_tree_requests
    from vllm_mtpspec.vllm.tree_step import ScheduledTree, TreeStep

    report["top_k_top_p"] = install_top_k_top_p_stand_in()
    gen = torch.Generator(device="cpu").manual_seed(0)
    for batch, shape in ((64, consensus_tree(4, max_nodes=16)), (64, chain_tree(4)), (1, consensus_tree(4, max_nodes=16))):
        trees = [ScheduledTree(i, shape, tuple(torch.randint(0, VOCAB, (len(shape),), generator=gen).tolist()))
                 for i in range(batch)]
        step, drafts = TreeStep(tuple(trees)), [len(shape)] * batch
        logits = (torch.randn(batch * (len(shape) + 1), VOCAB, generator=gen) * 3).to(device)
        # Make the drafts right often: put each node's token on top of its parent's row.
        for t in trees:
            base = t.batch_index * (len(shape) + 1)
            for node, parent in enumerate(shape.parents):
                if node % 3 == 0:
                    logits[base + parent + 1, t.tokens[node]] += 20.0
        out = torch.full((batch, len(shape) + 1), -1, device=device)
        greedy = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None, generators={})
        verdicts = verify_tree_requests(step, logits, drafts, greedy, out)
        host = logits.cpu()
        for t in trees:
            rows = slice(t.batch_index * (len(shape) + 1), (t.batch_index + 1) * (len(shape) + 1))
            assert verdicts[t.batch_index] == verify_greedy(shape, torch.tensor(t.tokens), host[rows])
        sampled_meta = SimpleNamespace(
            all_greedy=False, temperature=torch.full((batch,), 0.8, device=device),
            top_k=torch.full((batch,), 50, dtype=torch.int32, device=device),
            top_p=torch.full((batch,), 0.9, device=device),
            generators={i: torch.Generator(device=device).manual_seed(i) for i in range(0, batch, 2)})
        first = verify_tree_requests(step, logits, drafts, sampled_meta, out.clone())
        sampled_meta.generators = {i: torch.Generator(device=device).manual_seed(i) for i in range(0, batch, 2)}
        again = verify_tree_requests(step, logits, drafts, sampled_meta, out.clone())
        assert all(first[i] == again[i] for i in range(0, batch, 2)), "seeded requests must repeat"
        syncs = count_syncs(lambda: verify_tree_requests(step, logits, drafts, sampled_meta, out.clone()), device)
        label = f"batch {batch}, {'chain' if shape.is_chain else 'tree'} of {len(shape)}"
        report["verifier"][label] = {
            "greedy_ms": round(timed(lambda: verify_tree_requests(step, logits, drafts, greedy, out), device), 3),
            "sampled_ms": round(timed(lambda: verify_tree_requests(step, logits, drafts, sampled_meta, out), device), 3),
            "host_syncs_per_sampled_step": syncs,
            "mean_accepted_greedy": sum(len(v.accepted_nodes) for v in verdicts.values()) / batch,
        }
    report["verifier"]["sampled_first_token_tv_distance"] = sampled_first_token_distance(device)


def count_syncs(fn, device) -> int | str:
    if device.type != "cuda":
        return "n/a (not CUDA)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def sampled_first_token_distance(device, trials=20_000, vocab=16) -> float:
    """Total variation between the first emitted token's frequencies and the processed
    distribution (temperature 0.7, top-k 5), over many requests in one step."""
    from types import SimpleNamespace

    from vllm_mtpspec.tree import consensus_tree
    from vllm_mtpspec.vllm.tree_sampler import verify_tree_requests
    from vllm_mtpspec.vllm.tree_step import ScheduledTree, TreeStep

    shape = consensus_tree(2, max_nodes=4)
    root = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    logits = torch.randn(trials * (len(shape) + 1), vocab, device=device)
    logits.view(trials, len(shape) + 1, vocab)[:, 0] = root.to(device)
    tokens = tuple(int(t) for t in root.topk(len(shape)).indices)
    step = TreeStep(tuple(ScheduledTree(i, shape, tokens) for i in range(trials)))
    meta = SimpleNamespace(all_greedy=False, temperature=torch.full((trials,), 0.7, device=device),
                           top_k=torch.full((trials,), 5, dtype=torch.int32, device=device), top_p=None,
                           generators={})
    out = torch.full((trials, len(shape) + 1), -1, device=device)
    verdicts = verify_tree_requests(step, logits, [len(shape)] * trials, meta, out)
    counts = torch.bincount(torch.tensor([v.emitted[0] for v in verdicts.values()]), minlength=vocab).double()
    scaled = root / 0.7
    scaled[scaled.argsort()[: vocab - 5]] = -math.inf
    return round(0.5 * float((counts / trials - torch.softmax(scaled, -1).double()).abs().sum()), 4)


def check_heads(device, report) -> None:
    from vllm_mtpspec.checkpoint import load_heads
    from vllm_mtpspec.shipped import shipped_heads_dir

    for dtype in (torch.float16, torch.bfloat16):
        heads = load_heads(shipped_heads_dir(), device=device, dtype=dtype)
        d = heads.config.hidden_size
        lm_head = torch.nn.Linear(d, VOCAB, bias=False, device=device, dtype=dtype)
        embed = torch.nn.Embedding(VOCAB, d, device=device, dtype=dtype)
        for batch in (1, 16, 64):
            h = torch.randn(batch, d, device=device, dtype=dtype)
            tok = torch.randint(0, VOCAB, (batch,), device=device)

            def forward():
                with torch.inference_mode():
                    hidden = heads.hidden(h, embed(tok) if heads.config.token_conditioned else None)
                    return heads.project(hidden, lm_head).float().softmax(-1)

            report["heads"][f"{str(dtype).split('.')[-1]}, batch {batch}"] = round(timed(forward, device), 3)


def check_kernels(device, report) -> None:
    import os

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        report["kernels"] = "skipped: Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1"
        return
    from vllm_mtpspec.quant.int2 import int2_matmul_reference, quantize_int2
    from vllm_mtpspec.quant.triton_int2 import int2_matmul_triton

    for rows, cols, batch in ((2304, 1152, 1), (2304, 1152, 64), (576, 2304, 64)):
        weight = torch.randn(rows, cols) * 0.02
        qw = quantize_int2(weight.to(device), group_size=64)
        x = torch.randn(batch, cols, device=device, dtype=torch.float16)
        want, got = int2_matmul_reference(x, qw), int2_matmul_triton(x, qw)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        report["kernels"][f"int2 {rows}x{cols}, batch {batch}"] = {
            "triton_ms": round(timed(lambda: int2_matmul_triton(x, qw), device), 4),
            "torch_ms": round(timed(lambda: int2_matmul_reference(x, qw), device), 4)}
    # The tree-attention checks of the test suite, with every tensor made on the device.
    for test_file, label in (("test_triton_tree_attention.py", "tree attention vs PyTorch path"),
                             ("test_gpu_tree_attention.py", "tree rows through the GPU backends' forward wrapper")):
        started = time.perf_counter()
        run_test_check(test_file, device)
        report["kernels"][label] = f"equal ({time.perf_counter() - started:.1f} s)"


# (attention shape: query heads, KV heads, head size) and (tree requests, nodes each, cached tokens).
TREE_ROW_SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}
TREE_ROW_SIZES = ((1, 16, 512), (16, 16, 512), (16, 16, 2048), (64, 8, 512))


def time_tree_rows(device, report, shapes=TREE_ROW_SHAPES, sizes=TREE_ROW_SIZES, dtype=torch.bfloat16) -> None:
    """What recomputing the tree rows adds to each attention layer of a step on vLLM's
    GPU backends (gpu_tree_attention.py), and the step's host-side plan: the budget a
    tree's extra accepted tokens must pay for, beside the target's own step time."""
    from vllm_mtpspec.tree import consensus_tree
    from vllm_mtpspec.vllm.gpu_tree_attention import overwrite_tree_rows_paged, plan_paged_tree_attention
    from vllm_mtpspec.vllm.tree_step import ScheduledTree, TreeStep

    block_size = 16
    for name, (num_heads, num_kv_heads, head_size) in shapes.items():
        for requests, nodes, context in sizes:
            shape = consensus_tree(4, max_nodes=nodes)
            n = len(shape) + 1
            per_request = -(-(context + n) // block_size)
            kv_cache = torch.randn(requests * per_request, block_size, num_kv_heads, 2 * head_size, device=device,
                                   dtype=dtype).transpose(1, 2)  # the backends' view over NHD storage
            block_table = torch.arange(requests * per_request, device=device, dtype=torch.int32).view(requests, -1)
            seq_lens = torch.full((requests,), context + n, device=device, dtype=torch.int32)
            query = torch.randn(requests * n, num_heads, head_size, device=device, dtype=dtype)
            output = torch.empty_like(query)
            step = TreeStep(tuple(ScheduledTree(i, shape, tuple(range(len(shape)))) for i in range(requests)))
            starts = [i * n for i in range(requests + 1)]
            plan = plan_paged_tree_attention(step, starts, device)
            report["tree rows"][f"{name}, {requests} x {len(shape)} nodes, context {context}"] = {
                "per_layer_ms": round(timed(lambda: overwrite_tree_rows_paged(
                    plan, query, kv_cache, block_table, seq_lens, output, head_size, 1 / math.sqrt(head_size)),
                    device), 4),
                "plan_per_step_ms": round(timed(lambda: plan_paged_tree_attention(step, starts, device), device), 4)}


def time_tree_rows_on_cuda(device, report) -> None:
    if device.type != "cuda":
        report["tree rows"] = "skipped: timed on CUDA only"
        return
    report["tree rows"] = {}
    time_tree_rows(device, report)


def run_test_check(test_file: str, device) -> None:
    """A test file's CHECK script, read as text (the device has no pytest), run with torch's
    default device set to `device`."""
    path = Path(__file__).resolve().parents[1] / "tests" / test_file
    check = next(node.value.value for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "CHECK")
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        exec(compile(check, test_file, "exec"), {"__name__": "check"})
    finally:
        torch.set_default_device(previous)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the report as JSON here too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "verifier": {}, "heads": {}, "kernels": {}}
    for part in (check_verifier, check_heads, check_kernels, time_tree_rows_on_cuda):
        started = time.perf_counter()
        part(device, report)
        print(f"[gpu_check] {part.__name__} done in {time.perf_counter() - started:.1f} s", flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
