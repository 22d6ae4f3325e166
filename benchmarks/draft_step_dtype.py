"""One draft step of MLP heads (parallel or sequential) in each dtype, at batch 1 and 8:
the heads' layers and the LM-head projection (the draft vocabulary's rows in that dtype
where the heads have one, else the model's fp32 LM head), then top-1, as the proposer runs
them; median of --repeats, same process.

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
from vllm_mtpspec.vllm.platform_defaults import cpu_has_native_bf16
from vllm_mtpspec.weights import embedding_and_lm_head


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="heads directories, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embed, lm_head = embedding_and_lm_head(resolve_model("smollm2-135m-instruct", dtype="fp32"))
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    lines = [f"{platform.processor() or platform.machine()}, {args.threads} threads, native bf16: "
             f"{cpu_has_native_bf16()}; median of {args.repeats}", "",
             "| heads | " + " | ".join(f"{d} batch {b}".replace("torch.", "") for d in dtypes for b in batch_sizes)
             + " |", "|---|" + "---|" * (len(dtypes) * len(batch_sizes))]
    for path in args.heads.split(","):
        cells = []
        for dtype in dtypes:
            heads = load_heads(path, dtype=dtype).eval()
            table = embed.to(dtype)
            # As the proposer: the draft vocabulary's rows in the draft dtype; the whole
            # vocabulary through the model's own (fp32) LM head.
            if heads.draft_vocab is None:
                project = lambda x: x.float() @ lm_head.T  # noqa: E731
            else:
                project = heads.lm_head_for(lm_head.to(dtype))
            for b in batch_sizes:
                h, tokens = torch.randn(b, heads.config.hidden_size), torch.randint(0, table.shape[0], (b,))
                step = lambda: heads.draft_logits(h, table[tokens], heads.num_heads, project,  # noqa: E731
                                                  lambda t: table[t], heads.draft_vocab).argmax(-1)
                cells.append(f"{median_ms(step, args.repeats):.2f} ms")
        lines.append(f"| {heads.config.head_kind} [{Path(path).name}] | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
