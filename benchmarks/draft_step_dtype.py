"""One draft step of heads of any kind in each draft dtype, at batch 1 and 8: the heads'
layers and the LM-head projection (the draft vocabulary's rows in that dtype where the
heads have one, else the model's fp32 LM head), then top-1, as the proposer runs them;
median of --repeats, same process. `int8` is the proposer's INT8 drafting (the heads'
matrices and the draft vocabulary's rows through fbgemm, the rest in fp32). An attention
block's step is the proposer's: one accepted entry appended to a context of --context
entries per request, then the chain drafted depth by depth, and cut back.

    python benchmarks/draft_step_dtype.py --heads runs/head-kinds/v5-dv16k,runs/head-kinds/v5-continued-sequential-dv16k \
        --markdown benchmarks/results/draft_step_dtype.md
"""
import argparse
import platform
from pathlib import Path

import torch
from timing import median_ms

from vllm_mtpspec.checkpoint import load_heads
from vllm_mtpspec.models import resolve_model
from vllm_mtpspec.quant.int8_dynamic import Int8Linear, int8_linears
from vllm_mtpspec.vllm.platform_defaults import cpu_has_native_bf16
from vllm_mtpspec.weights import embedding_and_lm_head


def draft_step(path: str, dtype: str, batch: int, context: int, embed: torch.Tensor, lm_head: torch.Tensor):
    """The draft step of the heads at `path` in `dtype`, as a callable."""
    int8 = dtype == "int8"
    heads = load_heads(path, dtype=torch.float32 if int8 else getattr(torch, dtype)).eval()
    table = embed.to(heads.temperatures.dtype if int8 else getattr(torch, dtype))
    # As the proposer: the draft vocabulary's rows in the draft dtype; the whole
    # vocabulary through the model's own (fp32) LM head.
    if heads.draft_vocab is None:
        project = lambda x: x.float() @ lm_head.T  # noqa: E731
    elif int8:
        project = Int8Linear.from_weight(lm_head[heads.draft_vocab])
    else:
        project = heads.lm_head_for(lm_head.to(table.dtype))
    if int8:
        int8_linears(heads)
    gen = torch.Generator().manual_seed(0)
    d = heads.config.hidden_size
    h, tokens = torch.randn(batch, d, generator=gen).to(table.dtype), torch.randint(0, table.shape[0], (batch,),
                                                                                      generator=gen)
    if not heads.config.kind.keeps_context:
        return lambda: heads.draft_logits(h, table[tokens], heads.num_heads, project,
                                          lambda t: table[t], heads.draft_vocab).argmax(-1)
    # As the proposer drafts: fused products, a drafted token's input half from a table.
    heads.prepare_drafting(None if heads.draft_vocab is None else table[heads.draft_vocab])
    layers = len(heads.feature_layers or [])

    def layer_states(n):
        return torch.randn(n, layers, d, generator=gen).to(table.dtype) if layers else None

    caches = []
    for _ in range(batch):
        cache = heads.empty_cache()
        heads.extend(cache, torch.randn(context, d, generator=gen).to(table.dtype),
                     table[torch.randint(0, table.shape[0], (context,), generator=gen)], layer_states(context))
        caches.append(cache)
    newest_layers = None if not layers else [layer_states(1) for _ in range(batch)]

    def step():
        newest = torch.cat(heads.extend_many(caches, list(h[:, None]), list(table[tokens][:, None]), newest_layers))
        drafts = heads.draft_chains(caches, newest, heads.num_heads, project, lambda t: table[t],
                                    heads.draft_vocab).argmax(-1)
        for cache in caches:
            heads.truncate(cache, cache.start + context)
        return drafts
    return step


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="heads directories, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, int8")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=256, help="an attention block's context entries per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embed, lm_head = embedding_and_lm_head(resolve_model("smollm2-135m-instruct", dtype="fp32"))
    dtypes = args.dtypes.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    lines = [f"{platform.processor() or platform.machine()}, {args.threads} threads, native bf16: "
             f"{cpu_has_native_bf16()}; median of {args.repeats}", "",
             "| heads | " + " | ".join(f"{d} batch {b}" for d in dtypes for b in batch_sizes)
             + " |", "|---|" + "---|" * (len(dtypes) * len(batch_sizes))]
    for path in args.heads.split(","):
        cells = [f"{median_ms(draft_step(path, dtype, b, args.context, embed, lm_head), args.repeats):.2f} ms"
                 for dtype in dtypes for b in batch_sizes]
        kind = load_heads(path).config.head_kind
        lines.append(f"| {kind} [{Path(path).name}] | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
